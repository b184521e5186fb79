"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A decode step at small batch is ~400 short kernels in a row; between two of them the GPU drains one grid and only
then launches the next, so each boundary costs its launch latency and the previous grid's tail. With PDL a kernel
launched with `launch_pdl=True` may start while the previous one is still finishing:

- every such kernel calls `gdc_wait()` (pdl_wait) before it reads anything the previous kernels wrote or writes
  anything at all;
- it lets its successor launch (`gdc_launch_dependents()`) at its very start (mode `early`, the default) or right
  after its wait (mode `late`, at most one kernel waiting ahead of the one running);
- the one-row skinny linear kernel loads its first weight tile before the wait (weights never change during a
  step), so the weight stream starts under the previous kernel's tail.

In mode `early` a run of kernels can launch one another ahead, each holding SM slots while it waits. The
tensor-core skinny tile (`dot`, 2..16 rows) holds up to 160 KiB of shared memory a program: launched that way it
crowded out the attention kernel before it, and the decode step at 4 and 8 rows took 6.8 ms instead of 5.3 on an
H200 (benchmarks/lease_s12/pdl_first). So that kernel is never launched with PDL (it waits for the whole of the
kernel before it, as without PDL).

The wait blocks until the previous grid has completed and its writes are visible; as every PDL kernel waits
before it can complete, the order of a stream is kept transitively. A kernel that returns early must wait first.
Before its wait a kernel may read only what nothing in the process writes while serving (weights): in mode
`early` a chain of kernels can be launched ahead of kernels several places back, so even the KV pool's older
entries (copy-on-write, transfers, the same step's writes) are not safe to read there in general.
A kernel launched without PDL, or any torch kernel, still waits for the whole of the one before it.

`pdl_args(x)` gives a kernel launch its `PDL` constexpr and, on sm_90+ CUDA, `launch_pdl=True`; the Triton
interpreter (CPU tests) and older GPUs get `PDL=0`, where the kernels are exactly what they were.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pdserve.ops.dispatch import HAS_TRITON

MODES = {"off": 0, "early": 1, "late": 2}
_mode = "early"

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_launch_early(PDL: tl.constexpr):
        """At a kernel's start: in mode `early`, the next kernel may launch once every program got here."""
        if PDL == 1:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Before reading what earlier kernels wrote, or writing: wait for the previous kernel (and, in mode
        `late`, only then let the next one launch)."""
        if PDL != 0:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        pdl_launch_early(PDL)
        pdl_wait(PDL)


def set_pdl(mode: str | bool) -> str:
    """`early` (default), `late` or `off` (True/False: early/off) for the decode path's kernels on sm_90+; returns
    the previous mode. An A/B in one process (bench_steps.py --pdl)."""
    global _mode
    mode = {True: "early", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
    if mode not in MODES:
        raise ValueError(f"PDL mode must be one of {sorted(MODES)}, not {mode!r}")
    prev, _mode = _mode, mode
    return prev


@lru_cache(maxsize=16)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(x: torch.Tensor) -> bool:
    if _mode == "off" or not x.is_cuda:
        return False
    return _supported(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_args(x: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter (0 off, 1 early, 2 late), for tensors on
    x's device."""
    return {"PDL": MODES[_mode], "launch_pdl": True} if pdl_on(x) else {"PDL": 0}

"""The tensor-parallel sum through PyTorch symmetric memory (`--tp-all-reduce symm_mem`): each rank copies its
partial into a buffer every rank of the group has mapped, and one kernel per rank reads the peers' buffers over
NVLink and writes the sum (`torch.ops.symm_mem.one_shot_all_reduce_out`). No NCCL kernel and no multicast (the lent
machines keep NVLink multicast off), and it can be captured in a CUDA graph. Decode steps make 2 * layers + 1 small
all-reduces (8 KiB per row of a Qwen3-8B step); NCCL's latency per call is the likeliest reason why a TP=2 decode
step at batch 1 took 0.84x of TP=1's time on 2xH200 instead of about half (benchmarks/lease_s5/tp_tests).

Tensors larger than the buffer, of another dtype, or not 16-byte sized go to NCCL, as does everything on CPU.
Off by default until a 2-GPU run has measured it against NCCL (benchmarks/engine/bench_tp.py --all-reduce).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = 8 << 20  # the largest sum taken this way: a decode step of 1024 rows of hidden 4096 in bf16


class SymmAllReduce:
    """A symmetric buffer of `max_bytes` of `dtype` on this rank's GPU, rendezvoused with the group's ranks."""

    def __init__(self, pg, device: torch.device, dtype: torch.dtype, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        if device.type != "cuda":
            raise ValueError("--tp-all-reduce symm_mem needs CUDA devices")
        self.group_name = pg.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            enable(self.group_name)  # older torch needs it before the rendezvous
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.calls = 0  # sums taken this way (the rest went to NCCL)

    def accepts(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.max_numel
                and (x.numel() * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, into `x` (which `accepts` said yes to)."""
        n = x.numel()
        src = self.buffer[:n]
        src.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(src, "sum", self.group_name, x.view(-1))
        self.calls += 1
        return x


def make_symm_all_reduce(pg, device: torch.device, dtype: torch.dtype) -> SymmAllReduce:
    """The symmetric-memory sum for this group, checked against NCCL's on one tensor before it is used."""
    fast = SymmAllReduce(pg, device, dtype)
    rank = dist.get_rank(pg)
    x = (torch.arange(4096, device=device) % 64 + rank).to(dtype)  # small integers: exact in any dtype
    want = x.clone()
    dist.all_reduce(want, group=pg)
    fast(x)
    if not torch.equal(x, want):
        raise RuntimeError("the symmetric-memory all-reduce disagrees with NCCL's on its check tensor")
    log.info("tensor parallel: sums of up to %d MiB through symmetric memory", MAX_BYTES >> 20)
    return fast

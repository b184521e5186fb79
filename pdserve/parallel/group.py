"""The tensor-parallel group of one instance: its ranks' process group (NCCL on CUDA, gloo on CPU) and the two
collectives the sharded layers need — a sum over the ranks (row-parallel outputs, the embedding) and a gather of
vocabulary shards to rank 0 (logits) — plus a broadcast from rank 0 (a step's sampled tokens, which the next
step's placeholder rows read on every rank under async scheduling).

A group of size 1 calls no collective at all. Layers take the group that is current while the model is built
(`tp_context`), so a process may hold engines of different sizes one after another (tests: TP=1 and TP=2 side by
side) and the model classes keep Hugging Face's constructor signature.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Every process of a multi-GPU instance runs with these (the lent machines' NVLink multicast must stay off).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(eq=False)
class TPGroup:
    """This process's place in its instance's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    pg: Any = None  # the torch.distributed process group (None at size 1)
    fast: Any = None  # --tp-all-reduce symm_mem: the sum through symmetric memory (parallel/symm_allreduce.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (returns `x`; no collective at size 1)."""
        if self.size > 1:
            if self.fast is not None and self.fast.accepts(x):
                return self.fast(x)
            dist.all_reduce(x, group=self.pg)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (returns `x`; no collective at size 1). Every rank's `x` has the same
        shape and dtype; on NCCL it is queued on the current stream like any kernel (the host does not wait)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.pg)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `x` concatenated along the last dimension, in rank order; other ranks: None.
        Every rank's `x` has the same shape."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.pg)  # the group is the whole world: rank 0 is global rank 0
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TPGroup()
_current = SINGLE


def current_tp() -> TPGroup:
    """The group layers shard themselves for (size 1 outside `tp_context`)."""
    return _current


@contextmanager
def tp_context(group: TPGroup) -> Iterator[TPGroup]:
    """Build a model for `group`: layers constructed inside keep this rank's shard and this group."""
    global _current
    prev, _current = _current, group
    try:
        yield group
    finally:
        _current = prev


def master_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`.port`), created before the other ranks start."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def init_group(rank: int, size: int, device: torch.device, store_port: int, timeout_s: float,
               store: dist.TCPStore | None = None, all_reduce: str = "nccl",
               dtype: torch.dtype = torch.bfloat16) -> TPGroup:
    """Join the instance's process group (blocks until every rank joined or `timeout_s` passed) and check it with
    one all-reduce, which also creates the NCCL communicator outside any CUDA-graph capture. `timeout_s` is also
    the limit of every later collective. `all_reduce="symm_mem"`: sums of `dtype` up to a few MiB go through
    symmetric memory instead of NCCL (every rank must ask for the same)."""
    if size == 1:
        return SINGLE
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel engine "
                           "per process at a time")
    if device.type == "cuda":
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", store_port, size, False, timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    group = TPGroup(rank, size, dist.group.WORLD)
    try:  # a group that fails its checks is left again: this process may start another engine
        probe = torch.ones(1, device=device)
        group.all_reduce(probe)
        if float(probe.item()) != size:
            raise RuntimeError(f"tensor-parallel group check failed: all-reduce of ones gave {probe.item()}, "
                               f"not {size}")
        if all_reduce == "symm_mem":
            from pdserve.parallel.symm_allreduce import make_symm_all_reduce

            group.fast = make_symm_all_reduce(group.pg, device, dtype)
        elif all_reduce != "nccl":
            raise ValueError(f"unknown tensor-parallel all-reduce {all_reduce!r} (nccl | symm_mem)")
    except BaseException:
        destroy_group(group)
        raise
    return group


def destroy_group(group: TPGroup, timeout_s: float = 10.0) -> None:
    """Leave the process group. NCCL communicators used inside CUDA graphs can hang in destroy, and on torch 2.11
    the abort hung too (2xH200, rank 0 after its workers had exited), so either runs on a helper thread and is
    given up (with a warning) after `timeout_s`; the process's exit frees them."""
    if group.size == 1 or not dist.is_initialized():
        return

    def leave() -> None:
        if dist.get_backend() == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
                return
            except Exception as e:  # older torch: fall back to a destroy
                log.warning("aborting the NCCL group failed (%s); destroying it instead", e)
        dist.destroy_process_group()

    t = threading.Thread(target=leave, name="pdserve-tp-destroy", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("leaving the tensor-parallel process group did not finish within %.0f s", timeout_s)

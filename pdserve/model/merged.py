"""Merged projections that still load by Hugging Face names: several nn.Linear layers share one stacked weight
(QKV, gate_up), so the model runs one GEMM where the checkpoint has several matrices.

The stacked weight is a non-persistent buffer of the owner; each linear's parameter becomes a view of its rows.
Loaders and `load_state_dict` write through the views into the stacked storage, `state_dict()` keeps the
checkpoint's names, and no byte is held twice.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

_build = threading.local()  # .on: merged owners made inside `stacked_at_build` make their parts on the meta device


@contextlib.contextmanager
def stacked_at_build():
    """Around a model's construction (pdserve.model.loader.build_model): each merged projection allocates only its
    stacked weight; its parts are made on the meta device and become views of it. Made the other way (each part
    allocated, then stacked, then freed), the freed parts left holes in the caching allocator's segments between
    the weights: 0.55 GiB of dummy Qwen3-8B on an H200 (35 segments of 96 MiB, each holding 16 MiB free beside a
    QKV and an o_proj weight; benchmarks/engine/probe_memory.py, lease_s14), which the KV pool could not have.
    Values are not kept: the parts of a model built here are written by its loader or dummy init."""
    prev = getattr(_build, "on", False)
    _build.on = True
    try:
        yield
    finally:
        _build.on = prev


@contextlib.contextmanager
def merged_parts():
    """Around a merged owner's construction of its parts: on the meta device inside `stacked_at_build`."""
    if not getattr(_build, "on", False):
        yield
        return
    with torch.device("meta"):
        yield


def _aliased(stacked: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    off = 0
    for p in parts:
        if p.device != stacked.device or p.dtype != stacked.dtype or p.data_ptr() != stacked[off:].data_ptr():
            return False
        off += p.shape[0]
    return off == stacked.shape[0]


def merge_linears(owner: nn.Module, name: str, linears: list[nn.Linear]) -> None:
    """Stack `linears` (same input size) into `owner.<name>_weight` / `owner.<name>_bias` (None without biases)
    and make their parameters views of it. Idempotent; re-stacks after a `.to()` broke the aliasing."""
    for suffix in ("weight", "bias"):
        attr = f"{name}_{suffix}"
        parts = [getattr(lin, suffix) for lin in linears]
        if all(p is None for p in parts):
            owner.register_buffer(attr, None, persistent=False)
            continue
        if any(p is None for p in parts):
            raise ValueError(f"{name}: merged linears must all have a {suffix} or none")
        current = owner._buffers.get(attr)
        if current is not None and _aliased(current, parts):
            continue
        meta = all(p.is_meta for p in parts)  # made by merged_parts: the stacked tensor is the only allocation
        stacked = (torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype) if meta
                   else torch.cat([p.detach() for p in parts], dim=0))
        owner.register_buffer(attr, stacked, persistent=False)
        off = 0
        for lin, p in zip(linears, parts):
            n = p.shape[0]
            if meta:  # a meta parameter cannot take real storage through .data: a new one, with what rode on it
                view = nn.Parameter(stacked[off : off + n], requires_grad=p.requires_grad)
                view.__dict__.update(p.__dict__)  # (its tensor-parallel shard)
                setattr(lin, suffix, view)
            else:
                p.data = stacked[off : off + n]
            off += n


class MergedLinearOwner(nn.Module):
    """A module with merged projections: `_merged()` lists (name, linears); re-stacked after dtype/device moves."""

    def _merged(self) -> list[tuple[str, list[nn.Linear]]]:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for name, linears in self._merged():
            merge_linears(self, name, linears)
        return self

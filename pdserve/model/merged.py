"""Merged projections that still load by Hugging Face names: several nn.Linear layers share one stacked weight
(QKV, gate_up), so the model runs one GEMM where the checkpoint has several matrices.

The stacked weight is a non-persistent buffer of the owner; each linear's parameter becomes a view of its rows.
Loaders and `load_state_dict` write through the views into the stacked storage, `state_dict()` keeps the
checkpoint's names, and no byte is held twice.
"""

from __future__ import annotations

import torch
from torch import nn


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
        stacked = torch.cat([p.detach() for p in parts], dim=0)
        owner.register_buffer(attr, stacked, persistent=False)
        off = 0
        for p in parts:
            n = p.shape[0]
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

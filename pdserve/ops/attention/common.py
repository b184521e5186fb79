"""Small facts shared by the attention modules: which pool dtypes are fp8 and how far they reach."""

from __future__ import annotations

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2): stored values saturate there."""
    return float(torch.finfo(dtype).max)


def as_storage(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors viewed as uint8 (the same bytes) so that gathers and scatters work on every device."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t

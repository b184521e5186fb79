"""When the fused Triton kernels run: on CUDA tensors when Triton imports. Everything else (CPU serving, the
tests' oracle) takes the torch reference next to each kernel. Tests can force the kernels onto CPU tensors, where
they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the references serve
    HAS_TRITON = False

_force = False


def use_fused(x: torch.Tensor) -> bool:
    """True where the fused kernel should handle `x`: CUDA tensors (or any tensor under `force_fused`)."""
    return HAS_TRITON and (x.is_cuda or _force)


@contextmanager
def force_fused(enabled: bool = True):
    """Route every op to its Triton kernel whatever the device (tests: the interpreter on CPU)."""
    global _force
    prev, _force = _force, enabled
    try:
        yield
    finally:
        _force = prev


def num_warps_for(block: int) -> int:
    """Warps for a kernel whose program sweeps `block` elements of one row."""
    return 1 if block <= 256 else 2 if block <= 512 else 4 if block <= 2048 else 8 if block <= 8192 else 16

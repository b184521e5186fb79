"""Triton device helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh through exp2: saturates cleanly to +-1; absolute error ~1e-7 near 0 (enough for softcapping)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)

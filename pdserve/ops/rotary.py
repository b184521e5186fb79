"""Rotary embedding (neox: rotate halves) of queries and keys, with the per-head RMS norm that Qwen3 and Gemma 3
apply before it, as one Triton kernel over q and k in place; and the torch reference (the CPU path).

cos/sin are float32 caches `[max_positions, head_dim / 2]` indexed by each token's position inside the kernel
(no gathered copies). Llama passes no norm weights: rotary only.
"""

from __future__ import annotations

import torch

from pdserve.ops.dispatch import HAS_TRITON, use_fused
from pdserve.ops.norm import rms_norm_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _qk_norm_rope_kernel(Q, K, POS, COS, SIN, QW, KW, s_qt, s_qh, s_kt, s_kh, s_cos, n_qh, n_kh, eps, offset,
                             HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HB: tl.constexpr,
                             HAS_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        n_qb = tl.cdiv(n_qh, HB)
        if hb < n_qb:  # this program's heads are queries
            base = Q + t * s_qt
            s_h = s_qh
            h = hb * HB + tl.arange(0, HB)
            n_h = n_qh
            W = QW
        else:
            base = K + t * s_kt
            s_h = s_kh
            h = (hb - n_qb) * HB + tl.arange(0, HB)
            n_h = n_kh
            W = KW
        d = tl.arange(0, BLOCK_HALF)
        dmask = d < HALF
        m = (h < n_h)[:, None] & dmask[None, :]
        p1 = base + h[:, None].to(tl.int64) * s_h + d[None, :]
        x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            w1 = tl.load(W + d, mask=dmask, other=0.0).to(tl.float32) + offset
            w2 = tl.load(W + HALF + d, mask=dmask, other=0.0).to(tl.float32) + offset
            x1 = x1 * rstd[:, None] * w1[None, :]
            x2 = x2 * rstd[:, None] * w2[None, :]
        pos = tl.load(POS + t).to(tl.int64)
        c = tl.load(COS + pos * s_cos + d, mask=dmask, other=0.0)[None, :]
        s = tl.load(SIN + pos * s_cos + d, mask=dmask, other=0.0)[None, :]
        ty = Q.dtype.element_ty
        tl.store(p1, (x1 * c - x2 * s).to(ty), mask=m)
        tl.store(p1 + HALF, (x2 * c + x1 * s).to(ty), mask=m)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D/2] float32 -> rotated x in x's dtype (math in float32)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] -> new (q, k): per-head RMS norm when weights are given, then rotary."""
    if q_weight is not None:
        q = rms_norm_ref(q, q_weight, eps, offset)
        k = rms_norm_ref(k, k_weight, eps, offset)
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return rope_ref(q, c, s), rope_ref(k, c, s)


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (any token/head strides, head_dim contiguous); returns them."""
    t, n_qh, d = q.shape
    n_kh = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.dtype != q.dtype or d % 2:
        raise ValueError("qk_norm_rope needs q and k of one dtype, an even head_dim and head_dim contiguous")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos/sin caches must be contiguous [positions, head_dim / 2]")
    if t == 0:
        return q, k
    half = d // 2
    block_half = triton.next_power_of_2(half)
    hb = max(1, min(triton.next_power_of_2(max(n_qh, n_kh)), 512 // block_half))
    grid = (t, triton.cdiv(n_qh, hb) + triton.cdiv(n_kh, hb))
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[grid](
        q, k, positions, cos, sin, q_weight if has_norm else q, k_weight if has_norm else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), n_qh, n_kh, eps, float(offset),
        HALF=half, BLOCK_HALF=block_half, HB=hb, HAS_NORM=has_norm, num_warps=4 if hb * block_half >= 512 else 2,
    )
    return q, k


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized and rotated (q, k). The fused kernel works in place; use the returned tensors."""
    if use_fused(q):
        return qk_norm_rope_triton(q, k, positions, cos, sin, q_weight, k_weight, eps, offset)
    return qk_norm_rope_ref(q, k, positions, cos, sin, q_weight, k_weight, eps, offset)

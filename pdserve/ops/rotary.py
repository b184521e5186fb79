"""Rotary embedding (neox: rotate halves) of queries and keys, with the per-head RMS norm that Qwen3 and Gemma 3
apply before it, as one Triton kernel over q and k in place; and the torch reference (the CPU path).

cos/sin are float32 caches `[max_positions, head_dim / 2]` indexed by each token's position inside the kernel
(no gathered copies). Llama passes no norm weights: rotary only.
"""

from __future__ import annotations

import torch

from pdserve.ops.dispatch import HAS_TRITON, use_fused
from pdserve.ops.norm import rms_norm_ref
from pdserve.ops.pdl import pdl_args

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.ops.pdl import pdl_enter

    @triton.jit
    def _qk_norm_rope_kernel(Q, K, POS, COS, SIN, QW, KW, s_qt, s_qh, s_kt, s_kh, s_cos, n_qh, n_kh, eps, offset,
                             HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HB: tl.constexpr,
                             HAS_NORM: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)  # pdserve.ops.pdl
        # programs [0, n_qb) take HB query heads each, the rest HB key heads; both address sets are formed and
        # the other one masked off (no branch on which tensor: one straight-line kernel)
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        n_qb = tl.cdiv(n_qh, HB)
        is_q = hb < n_qb
        ar = tl.arange(0, HB)
        hq = hb * HB + ar
        hk = (hb - n_qb) * HB + ar
        d = tl.arange(0, BLOCK_HALF)
        dmask = d < HALF
        mq = ((hq < n_qh) & is_q)[:, None] & dmask[None, :]
        mk = ((hk >= 0) & (hk < n_kh))[:, None] & dmask[None, :]
        pq = Q + t * s_qt + hq[:, None].to(tl.int64) * s_qh + d[None, :]
        pk = K + t * s_kt + tl.maximum(hk, 0)[:, None].to(tl.int64) * s_kh + d[None, :]
        x1 = tl.load(pq, mask=mq, other=0.0).to(tl.float32) + tl.load(pk, mask=mk, other=0.0).to(tl.float32)
        x2 = tl.load(pq + HALF, mask=mq, other=0.0).to(tl.float32) + tl.load(pk + HALF, mask=mk, other=0.0).to(
            tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            w1 = tl.where(is_q, tl.load(QW + d, mask=dmask, other=0.0), tl.load(KW + d, mask=dmask, other=0.0))
            w2 = tl.where(is_q, tl.load(QW + HALF + d, mask=dmask, other=0.0),
                          tl.load(KW + HALF + d, mask=dmask, other=0.0))
            x1 = x1 * rstd[:, None] * (w1.to(tl.float32) + offset)[None, :]
            x2 = x2 * rstd[:, None] * (w2.to(tl.float32) + offset)[None, :]
        pos = tl.load(POS + t).to(tl.int64)
        c = tl.load(COS + pos * s_cos + d, mask=dmask, other=0.0)[None, :]
        s = tl.load(SIN + pos * s_cos + d, mask=dmask, other=0.0)[None, :]
        o1 = (x1 * c - x2 * s).to(Q.dtype.element_ty)
        o2 = (x2 * c + x1 * s).to(Q.dtype.element_ty)
        tl.store(pq, o1, mask=mq)
        tl.store(pq + HALF, o2, mask=mq)
        tl.store(pk, o1, mask=mk)
        tl.store(pk + HALF, o2, mask=mk)


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
        **pdl_args(q),
    )
    return q, k


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized and rotated (q, k). The fused kernel works in place; use the returned tensors."""
    if use_fused(q):
        return qk_norm_rope_triton(q, k, positions, cos, sin, q_weight, k_weight, eps, offset)
    return qk_norm_rope_ref(q, k, positions, cos, sin, q_weight, k_weight, eps, offset)

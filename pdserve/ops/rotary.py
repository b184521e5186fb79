"""Rotary embedding (neox: rotate halves) of queries and keys, with the per-head RMS norm that Qwen3 and Gemma 3
apply before it, as one Triton kernel over q and k in place; and the torch reference (the CPU path).

cos/sin are float32 caches `[max_positions, head_dim / 2]` indexed by each token's position inside the kernel
(no gathered copies). Llama passes no norm weights: rotary only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.ops.attention.common import fp8_max, is_fp8
from pdserve.ops.dispatch import HAS_TRITON, use_fused
from pdserve.ops.norm import rms_norm_ref
from pdserve.ops.pdl import pdl_args

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.ops.pdl import pdl_enter

    @triton.jit
    def _to_pool(x, S, FP8: tl.constexpr, HAS_S: tl.constexpr, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
        """A K or V value as the pool stores it: pdserve.ops.attention.kv_write's rounding (fp8: x / scale,
        saturated, round to nearest even)."""
        if FP8:
            xf = x.to(tl.float32)
            if HAS_S:
                xf = tl.math.div_rn(xf, tl.load(S))
            return tl.clamp(xf, -FP8_MAX, FP8_MAX).to(dtype)
        return x.to(dtype)

    @triton.jit(do_not_specialize_on_alignment=["SLOTS", "KS", "VS"])  # step metadata: see decode.METADATA_PTRS
    def _qk_norm_rope_kernel(Q, K, POS, COS, SIN, QW, KW, s_qt, s_qh, s_kt, s_kh, s_cos, n_qh, n_kh, eps, offset,
                             V, KV, SLOTS, KS, VS, n_slots, s_vt, s_vh, s_kvb, s_kvkv, s_kvt, s_kvh,
                             HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HB: tl.constexpr,
                             HAS_NORM: tl.constexpr, PDL: tl.constexpr, WRITE_KV: tl.constexpr = False,
                             BS: tl.constexpr = 16, FP8: tl.constexpr = False, HAS_KS: tl.constexpr = False,
                             HAS_VS: tl.constexpr = False, FP8_MAX: tl.constexpr = 0.0):
        """WRITE_KV: the key programs also store their rotated keys and the token's values into the pool at
        SLOTS[t] (tokens past n_slots and slots < 0 skipped), as pdserve.ops.attention.kv_write does: the KV
        write's own kernel folded into this one."""
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
        if WRITE_KV:
            slot = tl.load(SLOTS + t, mask=t < n_slots, other=-1).to(tl.int64)
            mw = mk & (slot >= 0)
            hw = tl.maximum(hk, 0)[:, None].to(tl.int64)
            dst = KV + (slot // BS) * s_kvb + (slot % BS) * s_kvt + hw * s_kvh + d[None, :]
            tl.store(dst, _to_pool(o1, KS, FP8, HAS_KS, FP8_MAX, KV.dtype.element_ty), mask=mw)
            tl.store(dst + HALF, _to_pool(o2, KS, FP8, HAS_KS, FP8_MAX, KV.dtype.element_ty), mask=mw)
            pv = V + t * s_vt + hw * s_vh + d[None, :]
            v1 = tl.load(pv, mask=mw, other=0.0)
            v2 = tl.load(pv + HALF, mask=mw, other=0.0)
            tl.store(dst + s_kvkv, _to_pool(v1, VS, FP8, HAS_VS, FP8_MAX, KV.dtype.element_ty), mask=mw)
            tl.store(dst + s_kvkv + HALF, _to_pool(v2, VS, FP8, HAS_VS, FP8_MAX, KV.dtype.element_ty), mask=mw)


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


@dataclass(frozen=True)
class KVDest:
    """Where a step's K/V go: one layer's view of the pool `[num_blocks, 2, block_size, Hk, D]`, the slot of each
    new token (`< 0`: skip; tokens past its length: skip), and the layer's fp8 scales (0-d float32, or None)."""

    kv_layer: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, offset: float = 0.0, v: torch.Tensor | None = None,
                        kv: KVDest | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (any token/head strides, head_dim contiguous); returns them. With `kv` (and v), the
    rotated keys and v are also written into the pool, as write_kv would (one kernel instead of two)."""
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
    write = {}
    if kv is not None:
        pool = kv.kv_layer
        if v is None or v.shape != k.shape or v.stride(-1) != 1 or pool.shape[3:] != k.shape[1:] \
                or pool.stride(-1) != 1:
            raise ValueError(f"the KV write needs v like k {tuple(k.shape)} and a pool of {tuple(k.shape[1:])} heads")
        fp8 = is_fp8(pool.dtype)
        slots = kv.slot_mapping
        write = dict(WRITE_KV=True, BS=pool.shape[2], FP8=fp8, HAS_KS=fp8 and kv.k_scale is not None,
                     HAS_VS=fp8 and kv.v_scale is not None, FP8_MAX=fp8_max(pool.dtype) if fp8 else 0.0)
        kv_args = (v, pool, slots, kv.k_scale if write["HAS_KS"] else slots, kv.v_scale if write["HAS_VS"] else slots,
                   slots.shape[0], v.stride(0), v.stride(1), *pool.stride()[:4])
    else:
        kv_args = (q, q, q, q, q, 0, 0, 0, 0, 0, 0, 0)  # never read without WRITE_KV
    _qk_norm_rope_kernel[grid](
        q, k, positions, cos, sin, q_weight if has_norm else q, k_weight if has_norm else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), n_qh, n_kh, eps, float(offset), *kv_args,
        HALF=half, BLOCK_HALF=block_half, HB=hb, HAS_NORM=has_norm, num_warps=4 if hb * block_half >= 512 else 2,
        **write, **pdl_args(q),
    )
    return q, k


_writes_kv = True


def set_rope_writes_kv(enabled: bool) -> bool:
    """Let the rotary kernel write the step's K/V into the pool where the backend allows it (default), or leave it
    to the backend's KV-write kernel (an A/B in one process); returns the previous setting."""
    global _writes_kv
    prev, _writes_kv = _writes_kv, enabled
    return prev


def rope_writes_kv(q: torch.Tensor) -> bool:
    """Whether qk_norm_rope(..., kv=) writes the pool for q's step (the fused kernel runs it)."""
    return _writes_kv and use_fused(q)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 offset: float = 0.0, v: torch.Tensor | None = None,
                 kv: KVDest | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized and rotated (q, k). The fused kernel works in place; use the returned tensors. `kv` (with v):
    the kernel also writes the rotated keys and v into the pool; only where rope_writes_kv(q)."""
    if use_fused(q):
        return qk_norm_rope_triton(q, k, positions, cos, sin, q_weight, k_weight, eps, offset, v, kv)
    if kv is not None:
        raise ValueError("the KV write goes with the fused kernel only (rope_writes_kv)")
    return qk_norm_rope_ref(q, k, positions, cos, sin, q_weight, k_weight, eps, offset)

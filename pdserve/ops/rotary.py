"""Rotary embedding (neox: rotate halves) of queries and keys, with the per-head RMS norm that Qwen3 and Gemma 3
apply before it, as one Triton kernel over q and k in place; and the torch reference (the CPU path).

cos/sin are float32 caches `[max_positions, head_dim / 2]` indexed by each token's position inside the kernel
(no gathered copies). Llama passes no norm weights: rotary only.
"""

from __future__ import annotations

import torch

from pdserve.ops.attention.common import KVTarget, check_kv_args, fp8_max, is_fp8
from pdserve.ops.attention.torch_ref import write_kv as write_kv_ref
from pdserve.ops.dispatch import HAS_TRITON, use_fused
from pdserve.ops.norm import rms_norm_ref
from pdserve.ops.pdl import pdl_args

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.ops.pdl import pdl_enter

    @triton.jit(do_not_specialize_on_alignment=["SLOTS", "KS", "VS"])  # step metadata: see decode.METADATA_PTRS
    def _qk_norm_rope_kernel(Q, K, POS, COS, SIN, QW, KW, V, KV, SLOTS, KS, VS,
                             s_qt, s_qh, s_kt, s_kh, s_cos, n_qh, n_kh, eps, offset,
                             s_vt, s_vh, s_kvb, s_kvkv, s_kvt, s_kvh, n_slots,
                             HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HB: tl.constexpr,
                             HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr,
                             HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
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
        if WRITE_KV:  # the key programs also put their rotated keys and the token's values into the pool at its slot
            slot = tl.load(SLOTS + t, mask=t < n_slots, other=-1)
            mw = mk & (slot >= 0)
            slot = tl.maximum(slot, 0).to(tl.int64)
            dst = KV + (slot // BS) * s_kvb + (slot % BS) * s_kvt + tl.maximum(hk, 0)[:, None].to(tl.int64) * s_kvh \
                + d[None, :]
            pv = V + t * s_vt + tl.maximum(hk, 0)[:, None].to(tl.int64) * s_vh + d[None, :]
            v1 = tl.load(pv, mask=mw, other=0.0)
            v2 = tl.load(pv + HALF, mask=mw, other=0.0)
            if FP8:  # as write_kv: the stored 16-bit key (and the value) / scale, saturated, nearest even
                k1 = o1.to(tl.float32)
                k2 = o2.to(tl.float32)
                v1 = v1.to(tl.float32)
                v2 = v2.to(tl.float32)
                if HAS_KS:
                    ks = tl.load(KS)
                    k1 = tl.math.div_rn(k1, ks)
                    k2 = tl.math.div_rn(k2, ks)
                if HAS_VS:
                    vs = tl.load(VS)
                    v1 = tl.math.div_rn(v1, vs)
                    v2 = tl.math.div_rn(v2, vs)
                k1 = tl.clamp(k1, -FP8_MAX, FP8_MAX)
                k2 = tl.clamp(k2, -FP8_MAX, FP8_MAX)
                v1 = tl.clamp(v1, -FP8_MAX, FP8_MAX)
                v2 = tl.clamp(v2, -FP8_MAX, FP8_MAX)
                tl.store(dst, k1.to(KV.dtype.element_ty), mask=mw)
                tl.store(dst + HALF, k2.to(KV.dtype.element_ty), mask=mw)
                tl.store(dst + s_kvkv, v1.to(KV.dtype.element_ty), mask=mw)
                tl.store(dst + s_kvkv + HALF, v2.to(KV.dtype.element_ty), mask=mw)
            else:
                tl.store(dst, o1.to(KV.dtype.element_ty), mask=mw)
                tl.store(dst + HALF, o2.to(KV.dtype.element_ty), mask=mw)
                tl.store(dst + s_kvkv, v1.to(KV.dtype.element_ty), mask=mw)
                tl.store(dst + s_kvkv + HALF, v2.to(KV.dtype.element_ty), mask=mw)


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
                        eps: float = 1e-6, offset: float = 0.0, v: torch.Tensor | None = None,
                        kv: KVTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (any token/head strides, head_dim contiguous); returns them. With `kv` (and `v`), the
    rotated keys and the values are also written into the pool at the tokens' slots, as write_kv would."""
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
    # programs of at most 512 elements; wider ones in long steps (1024-2048, up to 8 warps) were no faster and not
    # bitwise equal on an H200 (benchmarks/lease_s40/s40a)
    hb = max(1, min(triton.next_power_of_2(max(n_qh, n_kh)), 512 // block_half))
    grid = (t, triton.cdiv(n_qh, hb) + triton.cdiv(n_kh, hb))
    has_norm = q_weight is not None
    if kv is not None:
        pool = kv.kv_layer
        check_kv_args(pool, k, v)
        fp8 = is_fp8(pool.dtype)
        has_ks, has_vs = fp8 and kv.k_scale is not None, fp8 and kv.v_scale is not None
        slots = kv.slot_mapping
        write = dict(V=v, KV=pool, SLOTS=slots, KS=kv.k_scale if has_ks else slots, VS=kv.v_scale if has_vs else slots,
                     s_vt=v.stride(0), s_vh=v.stride(1), s_kvb=pool.stride(0), s_kvkv=pool.stride(1),
                     s_kvt=pool.stride(2), s_kvh=pool.stride(3), n_slots=slots.shape[0], WRITE_KV=True,
                     BS=pool.shape[2], FP8=fp8, HAS_KS=has_ks, HAS_VS=has_vs, FP8_MAX=fp8_max(pool.dtype) if fp8 else 0.0)
    else:  # never read
        write = dict(V=q, KV=q, SLOTS=positions, KS=positions, VS=positions, s_vt=0, s_vh=0, s_kvb=0, s_kvkv=0,
                     s_kvt=0, s_kvh=0, n_slots=0, WRITE_KV=False, BS=1, FP8=False, HAS_KS=False, HAS_VS=False,
                     FP8_MAX=0.0)
    _qk_norm_rope_kernel[grid](
        q, k, positions, cos, sin, q_weight if has_norm else q, k_weight if has_norm else q,
        s_qt=q.stride(0), s_qh=q.stride(1), s_kt=k.stride(0), s_kh=k.stride(1), s_cos=cos.stride(0), n_qh=n_qh,
        n_kh=n_kh, eps=eps, offset=float(offset), HALF=half, BLOCK_HALF=block_half, HB=hb, HAS_NORM=has_norm,
        num_warps=4 if hb * block_half >= 512 else 2, **write, **pdl_args(q),
    )
    return q, k


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 offset: float = 0.0, v: torch.Tensor | None = None,
                 kv: KVTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized and rotated (q, k). The fused kernel works in place; use the returned tensors. With `kv` (a layer's
    pool view and the step's slots) and `v`, the new keys (as returned) and values are also written into the pool
    (the Triton kernel does it in the same pass; the reference path calls the torch write_kv)."""
    if kv is not None and v is None:
        raise ValueError("qk_norm_rope: writing the KV needs v")
    if use_fused(q):
        return qk_norm_rope_triton(q, k, positions, cos, sin, q_weight, k_weight, eps, offset, v, kv)
    q, k = qk_norm_rope_ref(q, k, positions, cos, sin, q_weight, k_weight, eps, offset)
    if kv is not None:
        write_kv_ref(kv.kv_layer, k, v, kv.slot_mapping, kv.k_scale, kv.v_scale)
    return q, k

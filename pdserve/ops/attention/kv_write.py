"""Reshape-and-cache: one Triton kernel writes a step's new K and V ([T, Hk, D], any token/head strides) into one
layer's view of the block-major pool `[num_blocks, 2, block_size, Hk, D]` at `slot = block * block_size + offset`.

Slots < 0 are skipped (padded rows of CUDA-graph batches). An fp8 pool (float8_e4m3fn / float8_e5m2) stores
x / scale (per-tensor scales: 0-d float32 device tensors, read in the kernel, so no host sync), saturated to the
fp8 range and rounded to nearest even, as the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.attention.common import check_kv_args, fp8_max, is_fp8
from pdserve.ops.pdl import pdl_args, pdl_enter


@triton.jit(do_not_specialize_on_alignment=["SLOTS", "KS", "VS"])  # step metadata: see decode.METADATA_PTRS
def _write_kv_kernel(
    K, V, KV, SLOTS, KS, VS,
    s_kt, s_kh, s_vt, s_vh,
    s_kvb, s_kvkv, s_kvt, s_kvh,
    HK: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    FP8: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)  # pdserve.ops.pdl
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if slot < 0:
        return
    blk = slot // BS
    off = slot % BS
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < HK)[:, None] & (d < D)[None, :]
    dst = KV + blk * s_kvb + off * s_kvt + h[:, None] * s_kvh + d[None, :]
    k = tl.load(K + t.to(tl.int64) * s_kt + h[:, None] * s_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t.to(tl.int64) * s_vt + h[:, None] * s_vh + d[None, :], mask=mask, other=0.0)
    if FP8:
        kf = k.to(tl.float32)
        vf = v.to(tl.float32)
        if HAS_KS:
            kf = tl.math.div_rn(kf, tl.load(KS))
        if HAS_VS:
            vf = tl.math.div_rn(vf, tl.load(VS))
        kf = tl.clamp(kf, -FP8_MAX, FP8_MAX)
        vf = tl.clamp(vf, -FP8_MAX, FP8_MAX)
        tl.store(dst, kf.to(KV.dtype.element_ty), mask=mask)
        tl.store(dst + s_kvkv, vf.to(KV.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, k.to(KV.dtype.element_ty), mask=mask)
        tl.store(dst + s_kvkv, v.to(KV.dtype.element_ty), mask=mask)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hk, D] (T >= len(slot_mapping); extra rows are ignored) into `kv_layer` by slot."""
    t = slot_mapping.shape[0]
    if t == 0:
        return
    check_kv_args(kv_layer, k, v)
    hk, d = kv_layer.shape[3], kv_layer.shape[4]
    fp8 = is_fp8(kv_layer.dtype)
    dummy = slot_mapping  # never read: the scale pointers of a non-fp8 pool or an absent scale
    _write_kv_kernel[(t,)](
        k, v, kv_layer, slot_mapping,
        k_scale if (fp8 and k_scale is not None) else dummy, v_scale if (fp8 and v_scale is not None) else dummy,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        HK=hk, D=d, BLOCK_H=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d), BS=kv_layer.shape[2],
        FP8=fp8, HAS_KS=fp8 and k_scale is not None, HAS_VS=fp8 and v_scale is not None,
        FP8_MAX=fp8_max(kv_layer.dtype) if fp8 else 0.0,
        num_warps=4 if hk * d >= 1024 else 2, **pdl_args(k),
    )

"""Split-K paged decode: rows with one new token attend over their whole KV, read straight from the block-major pool
through the block table (no gather copy).

One program per (row, KV head, split) with the query heads of a GQA group packed into one tile, so each K/V tile
is loaded once per group; the splits of a row are merged by a second small kernel (skipped when there is one split).
A split's share is computed in the kernel from the row's own KV length, so a grid sized for an upper-bound length (a
CUDA graph) still spreads a short row over every split.
In a mixed batch the kernel reads the row's query offsets and leaves rows with more than one new token to the
prefill kernel. fp8 pools are read as fp8 and widened (to fp16, one instruction per pair) in registers; k_scale
folds into the softmax scale and v_scale into the output, accumulation is fp32.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from pdserve.ops.attention.common import QKRope, fp8_max, is_fp8
from pdserve.ops.attention.tl_math import tanh
from pdserve.ops.pdl import pdl_args, pdl_enter, pdl_launch_early, pdl_wait

# Integer arguments that change from step to step. Triton compiles a kernel again for every new specialization of an
# integer argument (equal to 1, a multiple of 16, neither), so each of these would cost a compile the first time a
# step's shape lands in another class: the block table's width (the longest sequence of the step, in blocks) and the
# number of splits the merge reads. Neither is an address the kernel could vectorize on.
VARYING_DECODE = ["s_btb"]
VARYING_MERGE = ["num_splits"]
# Step metadata (block tables, lengths, query offsets, the fp8 scales or their stand-ins): read an int at a time, so
# a 16-byte-aligned address buys nothing, and a specialization on it is one more compile whenever a caller's
# regions land otherwise (pdserve.engine.step_inputs aligns its regions; other callers need not).
METADATA_PTRS = ["BT", "SL", "QSL", "KS", "VS", "POS", "SLOTS"]
# The merge reads up to MERGE_SPLITS partials per (row, head) in one tile whatever the step's split count (a
# BLOCK_S that followed the split count made each power of two another compile: 2..64, times mixed or not; the
# masked lanes load nothing).
MERGE_SPLITS = 64


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (K, V as stored: widened here) into the online softmax's running max, sum and output."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if HAS_SOFTCAP:
        s = softcap * tanh(s / softcap)
    s = tl.where(valid[None, :], s * 1.4426950408889634, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _widen_fp8(x, E5M2: tl.constexpr):
    """An fp8 tile widened to fp16 by inline PTX (two cvt.rn.f16x2 a four-byte register), which Triton's layout passes
    leave where it stands: widened by `.to`, a V tile became the PV product's operand as fp8 and was read out of
    shared memory a byte at a time (ld.shared.b8, PTX for sm_90); widened here, it goes through shared memory as
    fp16 and out again by ldmatrix."""
    if E5M2:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_one(qk, v, valid, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """One key into the online softmax, as _attend_tile would take it: its dot with each query (qk [BLOCK_G]) and its
    value (v [D] in the queries' dtype); none where not `valid`."""
    s = qk * qk_scale
    if HAS_SOFTCAP:
        s = softcap * tanh(s / softcap)
    s = tl.where(valid, s * 1.4426950408889634, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    l_i = l_i * alpha + p
    return m_new, l_i, acc


@triton.jit(do_not_specialize=VARYING_DECODE, do_not_specialize_on_alignment=METADATA_PTRS)
def _decode_kernel(
    Q, KV, BT, SL, QSL, KS, VS, Out, PartO, PartM, PartL, POS, COS, SIN, QW, KW, KNEW, VNEW, SLOTS,
    s_qt, s_qh, s_ot, s_oh, s_cos, s_knt, s_knh, s_vnt, s_vnh, eps, offset,
    s_kvb, s_kvkv, s_kvt, s_kvh,
    s_btb,
    s_pb, s_ph, s_ps,
    sm_scale, softcap, window,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, MIXED: tl.constexpr, SINGLE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr, PDL: tl.constexpr, PREFETCH_BT: tl.constexpr = False, ROPE: tl.constexpr = False,
    HAS_QNORM: tl.constexpr = False, V_WIDEN: tl.constexpr = 0, FP8_MAX: tl.constexpr = 0.0,
    WRITE_VS: tl.constexpr = False,
):
    pdl_launch_early(PDL)  # pdserve.ops.pdl
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # Step metadata is written before the step's first kernel (a copy or a torch kernel, never launched early), so it
    # may be read before the wait below.
    one_new = True
    if MIXED:
        row = tl.load(QSL + b)
        one_new = tl.load(QSL + b + 1) - row == 1
    else:
        row = b
    row = row.to(tl.int64)
    seq_len = tl.load(SL + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    tps = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + sp * tps
    end = tl.minimum(start + tps, seq_len)
    if ROPE:  # the newest key is not in the pool yet: its split's tiles stop before it, and it is attended after them
        has_new = (seq_len - 1 >= start) & (seq_len - 1 < end)
        end = tl.minimum(end, seq_len - 1)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    h = hk * G + g
    gmask = g < G
    dmask = d < D
    # The split's first tile: its page ids before the wait (the block table is step metadata), its K/V after it (the
    # step's kernels before this one write the newest key).
    n = start + tl.arange(0, BLOCK_N)
    valid = n < end
    page = tl.maximum(tl.load(BT + b * s_btb + n // BS, mask=valid & one_new, other=0), 0)
    base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + hk * s_kvh
    if PREFETCH_BT:  # the block table a tile ahead (MANY_PROGRAMS_PREFETCH says why)
        n_next = n + BLOCK_N
        pg = tl.load(BT + b * s_btb + n_next // BS, mask=(n_next < end) & one_new, other=0)
    if ROPE:  # the rotary tables, norm weights and the row's position and slot: none written by this step's kernels
        dh = d % (D // 2)
        part = (d + D // 2) % D  # the other half's element: x * cos - x[part] * (sin, then -sin)
        pos = tl.load(POS + row).to(tl.int64)
        r_cos = tl.load(COS + pos * s_cos + dh, mask=dmask, other=0.0)
        r_sin = tl.load(SIN + pos * s_cos + dh, mask=dmask, other=0.0)
        r_sin = tl.where(d < D // 2, r_sin, -r_sin)
        if HAS_QNORM:
            wq = tl.load(QW + d, mask=dmask, other=0.0).to(tl.float32) + offset
            wq_part = tl.load(QW + part, mask=dmask, other=0.0).to(tl.float32) + offset
            wk = tl.load(KW + d, mask=dmask, other=0.0).to(tl.float32) + offset
            wk_part = tl.load(KW + part, mask=dmask, other=0.0).to(tl.float32) + offset
        slot = tl.load(SLOTS + row)
    pdl_wait(PDL)
    if not one_new:  # a prefill row of a mixed step: the prefill kernel's
        return
    kv_mask = valid[:, None] & dmask[None, :]
    k_first = tl.load(KV + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v_first = tl.load(KV + s_kvkv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if ROPE:  # q normed and rotated here; the split holding the newest key makes it and writes it (ROPE_IN_DECODE)
        qm = gmask[:, None] & dmask[None, :]
        pq = Q + row * s_qt + h[:, None] * s_qh
        xq = tl.load(pq + d[None, :], mask=qm, other=0.0).to(tl.float32)
        xq_part = tl.load(pq + part[None, :], mask=qm, other=0.0).to(tl.float32)
        if HAS_QNORM:
            rq = tl.rsqrt(tl.sum(xq * xq, 1) / D + eps)
            xq = xq * rq[:, None] * wq[None, :]
            xq_part = xq_part * rq[:, None] * wq_part[None, :]
        q = (xq * r_cos[None, :] - xq_part * r_sin[None, :]).to(Q.dtype.element_ty)
        km = dmask & has_new
        pk = KNEW + row * s_knt + hk * s_knh
        xk = tl.load(pk + d, mask=km, other=0.0).to(tl.float32)
        xk_part = tl.load(pk + part, mask=km, other=0.0).to(tl.float32)
        if HAS_QNORM:
            rk = tl.rsqrt(tl.sum(xk * xk, 0) / D + eps)
            xk = xk * rk * wk
            xk_part = xk_part * rk * wk_part
        if FP8_MAX > 0.0:  # an fp8 pool (ROPE_IN_DECODE_FP8): stored as the rotary kernel stores it, the 16-bit key
            # (and the value) / scale, saturated, nearest even; attended as stored, as the pool's other keys
            kf = (xk * r_cos - xk_part * r_sin).to(Q.dtype.element_ty).to(tl.float32)
            vf = tl.load(VNEW + row * s_vnt + hk * s_vnh + d, mask=km, other=0.0).to(tl.float32)
            if HAS_KS:
                kf = tl.math.div_rn(kf, tl.load(KS))
            if WRITE_VS:
                vf = tl.math.div_rn(vf, tl.load(VS))
            k_new = tl.clamp(kf, -FP8_MAX, FP8_MAX).to(KV.dtype.element_ty)
            v_new = tl.clamp(vf, -FP8_MAX, FP8_MAX).to(KV.dtype.element_ty)
        else:
            k_new = (xk * r_cos - xk_part * r_sin).to(Q.dtype.element_ty).to(KV.dtype.element_ty)
            v_new = tl.load(VNEW + row * s_vnt + hk * s_vnh + d, mask=km, other=0.0).to(KV.dtype.element_ty)
        qk_new = tl.sum(q.to(tl.float32) * k_new.to(Q.dtype.element_ty).to(tl.float32)[None, :], 1)
    else:
        q = tl.load(Q + row * s_qt + h[:, None] * s_qh + d[None, :], mask=gmask[:, None] & dmask[None, :],
                    other=0.0)
    if DOT_F16:  # fp8 pool: e4m3 widens to fp16 in one instruction per pair (to bf16 it takes three)
        q = q.to(tl.float16)
    if V_WIDEN:  # an fp8 pool's V widened by _widen_fp8 (1: e4m3, 2: e5m2)
        v_first = _widen_fp8(v_first, V_WIDEN == 2)
    qk_scale = sm_scale
    if HAS_KS:
        qk_scale = qk_scale * tl.load(KS)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend_tile(q, k_first, v_first, valid, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP,
                                 PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        if PREFETCH_BT:
            page = pg
            n_next = n + BLOCK_N
            pg = tl.load(BT + b * s_btb + n_next // BS, mask=n_next < end, other=0)
        else:
            page = tl.load(BT + b * s_btb + n // BS, mask=valid, other=0)
        page = tl.maximum(page, 0)  # -1 entries (padded rows) never address outside the pool
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + hk * s_kvh
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(KV + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(KV + s_kvkv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if V_WIDEN:
            v = _widen_fp8(v, V_WIDEN == 2)
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, softcap, HAS_SOFTCAP, PRECISION)
    if ROPE:  # the newest key, then the step's K/V into the pool (after every tile load of the split)
        m_i, l_i, acc = _attend_one(qk_new, v_new.to(Q.dtype.element_ty), has_new, m_i, l_i, acc, qk_scale, softcap,
                                    HAS_SOFTCAP)
        dst = KV + (tl.maximum(slot, 0) // BS) * s_kvb + (tl.maximum(slot, 0) % BS) * s_kvt + hk * s_kvh + d
        tl.store(dst, k_new, mask=km & (slot >= 0))
        tl.store(dst + s_kvkv, v_new, mask=km & (slot >= 0))
    if SINGLE:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if HAS_VS:
            out = out * tl.load(VS)
        tl.store(Out + row * s_ot + h[:, None] * s_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=gmask[:, None] & dmask[None, :])
    else:
        po = PartO + b * s_pb + h[:, None] * s_ph + sp * s_ps + d[None, :]
        tl.store(po, acc, mask=gmask[:, None] & dmask[None, :])
        pm = (b * tl.num_programs(1) * G + h) * num_splits + sp  # PartM/PartL: [B, Hq, splits] contiguous
        tl.store(PartM + pm, m_i, mask=gmask)
        tl.store(PartL + pm, l_i, mask=gmask)


@triton.jit(do_not_specialize=VARYING_MERGE, do_not_specialize_on_alignment=["QSL", "VS"])
def _merge_kernel(
    PartO, PartM, PartL, QSL, VS, Out,
    s_pb, s_ph, s_ps, s_ot, s_oh, num_splits,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, MIXED: tl.constexpr, HAS_VS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)  # pdserve.ops.pdl
    b = tl.program_id(0)
    h = tl.program_id(1)
    if MIXED:
        row = tl.load(QSL + b)
        if tl.load(QSL + b + 1) - row != 1:
            return
    else:
        row = b
    row = row.to(tl.int64)
    sidx = tl.arange(0, BLOCK_S)
    smask = sidx < num_splits
    pm = (b * tl.num_programs(1) + h) * num_splits + sidx
    m = tl.load(PartM + pm, mask=smask, other=float("-inf"))
    lse = tl.load(PartL + pm, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_safe), 0.0)
    denom = tl.sum(w * lse, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    o = tl.load(PartO + b * s_pb + h * s_ph + sidx[:, None] * s_ps + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    if HAS_VS:
        out = out * tl.load(VS)
    tl.store(Out + row * s_ot + h * s_oh + d, out.to(Out.dtype.element_ty), mask=dmask)


def decode_block_n(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys per inner step: 64 (fp32 queries: fewer, so the fp32 tiles stay in registers on sm_90)."""
    if dtype == torch.float32:
        return 32 if head_dim <= 128 else 16
    return 64


# (keys per step, warps, stages) of the decode kernel for 16-bit queries, by (pool is fp8, at least 8 rows), from
# benchmarks/attention/sweep_decode.py on an H200 (results_h200/decode_sweep_fp16dot.json): 128-key tiles keep
# more bytes in flight once there are rows enough to fill the GPU; a single row with many splits does better with 64.
DECODE_TILES = {(False, False): (64, 4, 2), (False, True): (128, 4, 3), (True, False): (64, 4, 3),
                (True, True): (128, 4, 3)}


# Rows x KV heads x splits for at least MANY_PROGRAM_WAVES waves of the GPU (a batch-256 step of Qwen3-8B: 2048
# programs of 1024 keys, one split) take 64-key tiles on a 16-bit pool (until session 23 with 3 stages and the page ids
# read in the same step, below: 2 stages and read a tile ahead): on an H200 they read 128 x 2048
# at 98.9 % of the HBM copy rate and 256 x 1024 at 98.2 %, against 95.3 % and 95.4 % with the 128-key tile, which
# stays ahead where fewer programs have more keys each (32 x 4096: 91.3 % against 76.2 %)
# (benchmarks/attention/results_h200/decode_sweep_fp16dot.json). None: the table alone (an A/B in bench_steps.py).
MANY_PROGRAMS_TILE: tuple[int, int, int] | None = (64, 4, 2)
# ... and on an fp8 pool (None: DECODE_TILES' fp8 tiles at any number of programs, without the read ahead below), with
# its V widened by inline PTX (FP8_V_WIDEN). At dummy Qwen3-30B-A3B's heads (32 over 4, d=128) on an H200, of the
# HBM copy rate (benchmarks/lease_s36/s36d, sweep_decode.py): 256 x 1024 keys 75.0 % against 59.4 % for the table's
# (128, 4, 3) without either, 256 x 2048 79.8 % against 64.0 %, 160 x 1536 (1.2 waves) 59.5 % against 56.1 %; the
# batch-256 decode step 24.24 ms against 25.91, its async loop 22.07 against 23.23.
MANY_PROGRAMS_TILE_FP8: tuple[int, int, int] | None = (64, 4, 3)
MANY_PROGRAM_WAVES = 4
# ... and read the block table a tile ahead (the kernel's PREFETCH_BT): the page ids of the next tile are loaded into
# a loop-carried value before this tile's K/V, so Triton's software pipeliner sees the K/V loads as direct ones. With
# the page ids loaded in the same step, the K/V loads are indirect and the pipeliner keeps one tile of them and waits
# for every copy at the top of each step, whatever num_stages (39 KB of shared memory at 2, 3 or 4 stages; ptxas on
# sm_90). At 256 rows x 1088 keys on an H200 the prefetching kernel at (64, 4, 2) took 260.8/261.2 and 266.0/266.6 us a
# layer against 263.2/263.0 and 268.4/268.4 for (64, 4, 3) without (benchmarks/lease_s23/s23f, s23g; two machines, two
# rounds each); with 3 stages it holds two K/V tiles (72 KB), fits 3 programs an SM instead of 4 and was slower.
MANY_PROGRAMS_PREFETCH = True

# Each split's first K/V tile is read after its PDL wait. Its older keys read before the wait measured no faster
# without a cost (dummy Qwen3-8B's batch-1 loops on H200s, benchmarks/lease_s30): K alone 8k 4.50/4.50 ms a step
# against 4.51/4.51, 32k 5.32/5.32 against 5.31/5.32; K and V 8k 4.45/4.45 but 32k 5.64/5.64 (held to 128 registers:
# 4.50/4.50 and 5.32/5.33). A one-row step's splits are fixed by the graph's length bound, so no rule by length could
# keep the 8k gain alone. Removed in session 40.

# FP8_V_WIDEN: an fp8 pool's V tiles widened to fp16 by inline PTX (_widen_fp8) rather than by `.to`, so that they
# reach the PV product through shared memory as fp16 (ldmatrix) instead of a byte at a time (ld.shared.b8: what
# Triton 3.6 makes of the `.to` on sm_90, benchmarks/attention/kernel_resources.py; it also takes the many-program
# tile (64, 4, 3) from 196 registers to 128 at the MoE's GQA 8). CUDA devices of compute capability 8.9 or later
# (the cvt to f16x2 from fp8 pairs); the Triton interpreter runs no inline PTX.
# - On in launches that take MANY_PROGRAMS_TILE_FP8 (measured there, above);
# - in the others (a few rows, the table's tiles) with FP8_V_WIDEN_FEW. Dummy Qwen3-30B-A3B (fp8 pool) on an H200, one
#   process an arm, in the order off, on, (on with ROPE_IN_DECODE_FP8), twice (benchmarks/lease_s37/s37b): batch-1
#   async loops at 1k 3.49/3.50 ms a step against 3.58/3.58 off, at 8k 3.76/3.77 against 3.84/3.84; the 32-row step at
#   4k 17.52/17.57 against 18.35/17.83. (bench_steps.py --decode-fp8-v-widen-few; sweep_decode.py --v-widen sets both.)
FP8_V_WIDEN = True
FP8_V_WIDEN_FEW = True
# ... and the registers a thread of an fp8 pool's launch may hold (ptxas' .maxnreg; 0: as the compiler likes): the
# many-row fp8 tile (128, 4, 3) takes about 250, two programs an SM. An A/B.
FP8_MAXNREG = 0


@lru_cache(maxsize=16)
def _fp8_cvt(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def v_widen(q: torch.Tensor, kv_dtype: torch.dtype, many: bool) -> int:
    """The decode kernel's V_WIDEN for a launch (`many`: taking the many-program tile): 0 (the `.to`), 1 (e4m3 by
    _widen_fp8), 2 (e5m2); FP8_V_WIDEN and FP8_V_WIDEN_FEW say where."""
    if not ((FP8_V_WIDEN_FEW, FP8_V_WIDEN)[many] and is_fp8(kv_dtype) and q.is_cuda and q.dtype != torch.float32):
        return 0
    if not _fp8_cvt(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return 0
    return 2 if kv_dtype == torch.float8_e5m2 else 1


# The splits are merged by _merge_kernel. Merged by the decode kernel's last split to finish (an acquire-release count
# a (row, KV head), one launch a layer less), dummy Qwen3-8B's batch-1 loops were slower: 8k 4.50/4.50 ms a step
# against 4.47/4.47, 32k 5.29/5.30 against 5.27/5.27 (benchmarks/lease_s31/s31d). Removed in session 40.


# ROPE_IN_DECODE: a decode-only launch applies the layer's QK-norm and rotary itself, from the q/k/v product's output,
# and writes the step's new K/V, in place of the rotary kernel before it (one launch a layer less: in the batch-1
# loops that kernel added 1.9 us a layer to the step, lease_s31/s31c).
# - Each program norms and rotates its GQA group's queries after the PDL wait (the rotary tables, the norm weights,
#   the row's position and slot before it), while its first K/V tile is in flight.
# - The split whose keys end at the row's newest stops its tiles before that key (not yet in the pool), makes the key
#   and takes it into its softmax after them (_attend_one), then stores it and the value at the row's slot.
# - No other program of the step reads that slot: each row's newest key lies in one split, and a decode-only step has
#   no prefill rows.
# Where (rope_in_decode), from ptxas on sm_90 (bf16, GQA 4, benchmarks/attention/kernel_resources.py):
# - models with a QK-norm (Qwen3) and head dims up to 128, on pools of the queries' dtype. The one-row tile (64, 4, 2)
#   takes 145 registers with it (114 without: 4 programs an SM to 3), so its launches are held to ROPE_MAXNREG, where
#   it spills nothing. Without a norm (Llama) the same kernel took 216 and spilled 306 bytes at 128; at head dim 256
#   (Gemma 3) 255 and a spill unlimited. Those, fp8 pools and mixed steps keep the rotary kernel;
# - not launches of MANY_PROGRAM_WAVES waves (a batch-256 step: 144 registers against 122, a spill at 128): the
#   backend runs the rotary kernel before them.
# On (dummy Qwen3-8B, batch-1 loops at temperature 1 on an H200, one process an arm, in the order off, on, on without
# ROPE_MAXNREG, twice; benchmarks/lease_s31/s31e): 8k 4.45/4.44 ms a step against 4.46/4.46 off, 32k 5.25/5.25
# against 5.27/5.27, 64 rows at 2k 9.69/9.68 against 9.68/9.68. Without the register limit, 32k took 5.64/5.64.
ROPE_IN_DECODE = True
ROPE_MAXNREG = 128
# (In launches of MANY_PROGRAM_WAVES waves too, dummy Qwen3-8B's batch-256 loop took 17.17/17.16 ms a step against
# 16.81/16.80 without, benchmarks/lease_s32/s32a: those keep the rotary kernel.)
# ... and on fp8 pools (16-bit queries; with FP8_V_WIDEN_FEW, rope_pool says why): the kernel quantizes the new key
# and value as the rotary kernel does (the stored 16-bit key / k_scale, saturated, nearest even) and attends to the key
# as stored. Only in launches whose tile has at most ROPE_FP8_MAX_KEYS keys (a few rows: DECODE_TILES' (64, 4, 3)).
# Dummy Qwen3-30B-A3B on an H200, with FP8_V_WIDEN_FEW, against FP8_V_WIDEN_FEW alone (benchmarks/lease_s37/s37b, two
# rounds): batch-1 async loops at 1k 3.42/3.42 ms a step against 3.49/3.50, at 8k 3.70/3.70 against 3.76/3.77 (a MoE
# batch-1 step's rotary kernel took 210 us of marginal time, benchmarks/lease_s35/s35d); but the 32-row step at 4k,
# whose launches take the (128, 4, 3) tile, 18.30/18.26 ms against 17.52/17.57, hence the bound on the tile.
ROPE_IN_DECODE_FP8 = True
ROPE_FP8_MAX_KEYS = 64


def rope_in_decode(q: torch.Tensor, kv_layer: torch.Tensor, rope: QKRope, num_programs: int = 0) -> bool:
    """Whether a decode-only launch of `num_programs` programs (0: not yet known) over `kv_layer` takes the layer's
    QK-norm and rotary (ROPE_IN_DECODE says where)."""
    d = q.shape[-1]
    fp8 = is_fp8(kv_layer.dtype)
    many = many_programs(q.dtype, fp8, num_programs, q.device)
    if fp8 and q.dtype != torch.float32 and (
            many or decode_tile(d, q.dtype, True, q.shape[0], num_programs, q.device)[0] > ROPE_FP8_MAX_KEYS):
        return False
    return (ROPE_IN_DECODE and rope_pool(q, kv_layer.dtype) and rope.q_weight is not None and 2 <= d <= 128
            and d & (d - 1) == 0 and not many)


def rope_pool(q: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    """Whether the decode kernel's rotary can write into a pool of `kv_dtype`: q's own, or fp8 with
    ROPE_IN_DECODE_FP8 (16-bit queries) where the launch widens V by PTX (FP8_V_WIDEN_FEW; on sm_90 the one-row
    tile with the rotary spilled 304 bytes at ROPE_MAXNREG with the `.to`, none with V by PTX:
    benchmarks/attention/kernel_resources.py), or on the Triton interpreter."""
    if kv_dtype == q.dtype:
        return True
    return (ROPE_IN_DECODE_FP8 and is_fp8(kv_dtype) and q.dtype != torch.float32
            and (not q.is_cuda or v_widen(q, kv_dtype, False) > 0))


def many_tile(fp8: bool) -> tuple[int, int, int] | None:
    """The many-program tile of a 16-bit (MANY_PROGRAMS_TILE) or an fp8 pool (MANY_PROGRAMS_TILE_FP8); None: none."""
    return MANY_PROGRAMS_TILE_FP8 if fp8 else MANY_PROGRAMS_TILE


def many_program_rows(num_kv_heads: int, device: torch.device) -> int:
    """Decode rows from which a step's decode kernel takes its many-program tile (one split; the warm-up runs a mixed
    step of that many rows so serving compiles nothing)."""
    return triton.cdiv(MANY_PROGRAM_WAVES * num_sms(device), max(1, num_kv_heads))


def many_program_split_rows(num_kv_heads: int, max_seq_len: int, device: torch.device, fp8: bool = False) -> int:
    """The fewest rows (2 or more, below many_program_rows) whose step at `max_seq_len` keys takes the many-program
    tile (of an fp8 pool: `fp8`) with several splits (rows x KV heads x splits reach the waves: on an H200 with 8 KV
    heads, 2 rows of 2112+ keys take 33 splits, 6 rows of 704+ take 11); 0 where none does. The warm-up runs a mixed
    step of that many rows: a prompt arriving beside 5 decoding requests compiled it while serving (lease_s18)."""
    if many_tile(fp8) is None:
        return 0
    waves = MANY_PROGRAM_WAVES * num_sms(device)
    for rows in range(2, many_program_rows(num_kv_heads, device)):
        splits = decode_splits(rows, num_kv_heads, max_seq_len, None, device)
        if splits > 1 and rows * num_kv_heads * splits >= waves:
            return rows
    return 0


def many_programs(dtype: torch.dtype, fp8: bool, num_programs: int, device: torch.device | None) -> bool:
    """Whether a launch of `num_programs` programs (16-bit queries) takes the pool's many-program tile (many_tile)."""
    return (dtype != torch.float32 and many_tile(fp8) is not None and device is not None
            and num_programs >= MANY_PROGRAM_WAVES * num_sms(device))


def decode_tile(head_dim: int, dtype: torch.dtype, fp8: bool, num_rows: int = 8, num_programs: int = 0,
                device: torch.device | None = None) -> tuple[int, int, int]:
    """(keys per step, warps, stages) for a launch of `num_programs` programs (rows x KV heads x splits)."""
    if dtype == torch.float32:
        return decode_block_n(16, head_dim, dtype), 4, 2
    if many_programs(dtype, fp8, num_programs, device):
        return many_tile(fp8)
    return DECODE_TILES[(fp8, num_rows >= 8)]


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (tests on CPU)
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# decode_splits' rule: programs for about DECODE_WAVES waves of the GPU, at least MIN_SPLIT_KEYS keys a split
# (benchmarks/engine/bench_steps.py --decode-waves / --min-split-keys change them for an A/B in one process). 4 waves
# and 64 keys against the earlier 2 and 256, whole decode steps of dummy Qwen3-8B on an H200 in the order old, new,
# new, old (benchmarks/lease_s13): 1 row at 1k 4.87/4.84 -> 4.86/4.56 ms, at 8k 5.20/5.22 -> 4.97/4.92, at 32k
# 6.28/6.50 -> 5.88/5.78; 4 rows at 8k 6.81/6.79 -> 6.40/6.57; 16 rows at 1k 6.38/6.05 -> 6.06/6.01. The async
# engine loop at 1 row and 8k did not move (4.63 ms a step either way). 256 rows get one split with both. The
# warm-up's short-only steps (engine/warmup.py SHORT_ONLY, SHORT_MANY) stay under MIN_SPLIT_KEYS: one split.
DECODE_WAVES = 4
MIN_SPLIT_KEYS = 64


def decode_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, sliding_window: int | None,
                  device: torch.device) -> int:
    """Splits per (row, KV head): enough programs for about DECODE_WAVES waves, at least MIN_SPLIT_KEYS keys a
    split, at most MERGE_SPLITS."""
    span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    want = max(1, (DECODE_WAVES * num_sms(device)) // max(1, num_rows * num_kv_heads))
    return max(1, min(want, triton.cdiv(max(span, 1), MIN_SPLIT_KEYS), MERGE_SPLITS))


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 max_seq_len: int, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 query_start_loc: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 num_splits: int | None = None, tile: tuple[int, int, int] | None = None,
                 prefetch: bool | None = None, rope: QKRope | None = None,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of rows with one new token.

    q [T, Hq, D]; kv_layer [num_blocks, 2, block_size, Hk, D] (any strides, D contiguous); block_tables [B, W] and
    seq_lens [B] int32 on device. Without `query_start_loc`, row b's query is token b (a decode-only batch); with it
    ([B+1] int32), row b's query is token query_start_loc[b] and rows with another count of new tokens are skipped
    (their output rows are left as they are). Returns `out` ([T, Hq, D], allocated if not given). `tile` =
    (keys per step, warps, stages) overrides decode_tile's choice (benchmarks/attention/sweep_decode.py), `prefetch`
    the block table read a tile ahead (None: with MANY_PROGRAMS_TILE, as MANY_PROGRAMS_PREFETCH says).

    With `rope` (a decode-only launch: no `query_start_loc`), q, `k` and `v` [B, H, D] are the q/k/v product's
    output: the kernel norms and rotates q and each row's new key itself and writes that key and `v` into the pool
    at `slot_mapping` ([B] or longer; < 0: no write), as qk_norm_rope(kv=...) would before a launch without it
    (ROPE_IN_DECODE says how).
    """
    b = seq_lens.shape[0]
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("q and the pool need a contiguous head dimension")
    _, hq, d = q.shape
    bs, hk = kv_layer.shape[2], kv_layer.shape[3]
    g = hq // hk
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if b == 0:
        return out
    fp8 = is_fp8(kv_layer.dtype)
    if rope is not None:
        if query_start_loc is not None or not rope_pool(q, kv_layer.dtype) or d & (d - 1) or d < 2 or k is None \
                or v is None or slot_mapping is None or slot_mapping.shape[0] < b or k.stride(-1) != 1 \
                or v.stride(-1) != 1:
            raise ValueError("the decode kernel's rotary needs a decode-only launch, a pool of q's dtype (or fp8 with "
                             "ROPE_IN_DECODE_FP8), a power-of-two head dim, k and v with a contiguous head dim and a "
                             "slot for every row")
    has_ks, has_vs = fp8 and k_scale is not None, fp8 and v_scale is not None
    splits = num_splits or decode_splits(b, hk, max_seq_len, sliding_window, q.device)
    single = splits == 1
    block_d = triton.next_power_of_2(d)
    block_n, warps, stages = tile or decode_tile(d, q.dtype, fp8, b, b * hk * splits, q.device)
    many = many_programs(q.dtype, fp8, b * hk * splits, q.device)
    if prefetch is None:
        prefetch = tile is None and MANY_PROGRAMS_PREFETCH and many
    limits = {}
    if rope is not None and block_n <= 64 and ROPE_MAXNREG and q.is_cuda:
        limits = {"maxnreg": ROPE_MAXNREG}
    if fp8 and FP8_MAXNREG and q.is_cuda:
        limits = {"maxnreg": FP8_MAXNREG}
    if single:
        part_o = part_m = part_l = out
        s_p = (0, 0, 0)
    else:
        part_o = torch.empty((b, hq, splits, block_d), dtype=torch.float32, device=q.device)
        part_m = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
        s_p = (part_o.stride(0), part_o.stride(1), part_o.stride(2))
    mixed = query_start_loc is not None
    qsl = query_start_loc if mixed else seq_lens
    ks = k_scale if has_ks else seq_lens
    vs = v_scale if has_vs else seq_lens
    if rope is not None:
        has_qnorm = rope.q_weight is not None
        r_args = (rope.positions, rope.cos, rope.sin, rope.q_weight if has_qnorm else rope.cos,
                  rope.k_weight if has_qnorm else rope.cos, k, v, slot_mapping)
        r_strides = (rope.cos.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), rope.eps,
                     float(rope.offset))
    else:  # never read
        has_qnorm = False
        r_args = (seq_lens,) + (q,) * 6 + (seq_lens,)  # as aligned as the real ones: no other specialization
        r_strides = (0, 0, 0, 0, 0, 0.0, 0.0)
    # Rows first in the grid. KV heads first (a row's heads, which share each block of the pool, side by side) read
    # no faster at 256 rows, nor did blocks of 2.25 MiB against 0.75 (benchmarks/lease_s33/s33a).
    _decode_kernel[(b, hk, splits)](
        q, kv_layer, block_tables, seq_lens, qsl, ks, vs, out, part_o, part_m, part_l, *r_args,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *r_strides,
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        *s_p,
        scale, softcap or 1.0, sliding_window or 0,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=block_d, BS=bs,
        BLOCK_N=block_n, MIXED=mixed, SINGLE=single, HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=softcap is not None, HAS_KS=has_ks, HAS_VS=has_vs and single,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_F16=fp8 and q.dtype != torch.float32,
        PREFETCH_BT=prefetch, ROPE=rope is not None, HAS_QNORM=has_qnorm,
        V_WIDEN=v_widen(q, kv_layer.dtype, many), FP8_MAX=fp8_max(kv_layer.dtype) if fp8 and rope is not None else 0.0,
        WRITE_VS=has_vs and rope is not None, num_warps=warps,
        num_stages=stages, **limits, **pdl_args(q),
    )
    if not single:
        _merge_kernel[(b, hq)](
            part_o, part_m, part_l, qsl, vs, out,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), out.stride(0), out.stride(1), splits,
            D=d, BLOCK_D=block_d, BLOCK_S=max(MERGE_SPLITS, triton.next_power_of_2(splits)), MIXED=mixed, HAS_VS=has_vs,
            **pdl_args(q),
        )
    return out

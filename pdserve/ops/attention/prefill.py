"""Varlen paged prefill attention (FlashAttention-2 style) reading K/V straight from the block-major pool.

One launch covers every row of a step with more than one new token: whole prompts and chunks on a prefix already
in the pool. Program (p, hp) takes entry p // SUB of the tile table (see metadata.py) and its (p % SUB)-th part of
BLOCK_Q queries, and the query heads hp * G_PACK ... (G_PACK query heads of one KV group share every K/V tile load:
a tile has BLOCK_M = BLOCK_Q * G_PACK rows). Online softmax over BLOCK_N keys at a time, exp2 with the scale
folded in, fp32 accumulation. Causal with the query offset (KV length - new tokens) and optional sliding window; the
key range splits into up to three loops so only the blocks at the window edge and on the diagonal pay for masks.
fp8 pools are widened in registers (k_scale folds into the softmax scale, v_scale into the output); softcapping is
applied to the scaled scores (Gemma 2 style).

Given the step's own K/V (k_new/v_new, what the backend has just written into the pool), each of those ranges
splits once more at ctx (the row's KV length before the step): whole key tiles below it come from the pool, the
tile holding it (if ctx is not a multiple of BLOCK_N) from both, the tiles above from k_new/v_new. Those need no
block-table lookup and no widening of an fp8 pool (widening fp8 tiles is what made fp8 pools slower than bf16 on
an H200), and they are exact: an fp8 pool holds the new tokens quantized. Pool tiles then apply v_scale to p before
the PV dot (the step's V is unscaled), instead of to the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve import envs
from pdserve.ops.attention.common import is_fp8
from pdserve.ops.attention.metadata import PREFILL_TILE
from pdserve.ops.attention.tl_math import tanh

# The block table's width changes with the step's longest sequence: not specialized on (decode.VARYING_DECODE says
# why).
VARYING_PREFILL = ["s_btb"]
PREFILL_METADATA_PTRS = ["BT", "SL", "QSL", "TILES", "KS", "VS"]  # not specialized on alignment (decode.py says why)


POOL: tl.constexpr = tl.constexpr(0)  # key tiles read through the block table
NEW: tl.constexpr = tl.constexpr(1)  # key tiles read from the step's own K/V rows
STRADDLE: tl.constexpr = tl.constexpr(2)  # the one tile holding ctx: the pool below it, the step's rows from it


@triton.jit
def _kv_tile(KV, base, NEWP, rows, s_nt, n, ctx, seq_len, scale, d, dmask,
             SRC: tl.constexpr, MASKED: tl.constexpr, HAS_SCALE: tl.constexpr, PAD_D: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] K (or V) tile of keys n. POOL: at pool offsets `base` (raw: its scale is applied by
    the caller); NEW: the step's rows `rows` of NEWP; STRADDLE: the pool below ctx, already multiplied by its scale
    in fp32 and rounded to the step's dtype (as the torch reference dequantizes), and the step's rows from ctx on."""
    if SRC == POOL:
        if PAD_D:
            x = tl.load(KV + base[:, None] + d[None, :], mask=dmask[None, :], other=0.0)
        else:
            x = tl.load(KV + base[:, None] + d[None, :])
    elif SRC == NEW:
        ptr = NEWP + rows[:, None] * s_nt + d[None, :]
        if MASKED and PAD_D:
            x = tl.load(ptr, mask=(n < seq_len)[:, None] & dmask[None, :], other=0.0)
        elif MASKED:
            x = tl.load(ptr, mask=(n < seq_len)[:, None], other=0.0)
        elif PAD_D:
            x = tl.load(ptr, mask=dmask[None, :], other=0.0)
        else:
            x = tl.load(ptr)
    else:
        old = (n < ctx)[:, None]
        new = (n >= ctx)[:, None] & (n < seq_len)[:, None]
        if PAD_D:
            old = old & dmask[None, :]
            new = new & dmask[None, :]
        xp = tl.load(KV + base[:, None] + d[None, :], mask=old, other=0.0)
        if HAS_SCALE:
            xp = xp.to(tl.float32) * scale
        xn = tl.load(NEWP + rows[:, None] * s_nt + d[None, :], mask=new, other=0.0)
        x = tl.where((n < ctx)[:, None], xp.to(xn.dtype), xn)
    return x


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, n0, pos, seq_len, qk_scale, k_scale, v_scale,
    softcap, window, d, dmask,
    s_kvb, s_kvkv, s_kvt, s_knt, s_vnt,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SRC: tl.constexpr, HAS_KS: tl.constexpr,
    HAS_VS: tl.constexpr, SCALE_P: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0 ... n0 + BLOCK_N - 1 from the source SRC. SCALE_P: POOL tiles multiply
    p by v_scale before the PV dot (when new tiles, whose V is unscaled, share the accumulator); otherwise the
    caller scales the output."""
    n = n0 + tl.arange(0, BLOCK_N)
    base = n  # unused by NEW tiles
    rows = n.to(tl.int64)  # unused by POOL tiles
    if SRC == STRADDLE:
        page = tl.load(bt_row + n // BS, mask=n < ctx, other=0)
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + kv_off
    elif SRC == POOL:
        if MASKED:
            page = tl.load(bt_row + n // BS, mask=n < seq_len, other=0)
        else:
            page = tl.load(bt_row + n // BS)
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + kv_off
    if SRC != POOL:
        rows = (new_row0 + n).to(tl.int64)
    k = _kv_tile(KV, base, KN, rows, s_knt, n, ctx, seq_len, k_scale, d, dmask, SRC, MASKED, HAS_KS, PAD_D)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    if HAS_SOFTCAP:
        s = (softcap * 1.4426950408889634) * tanh(s * (qk_scale / softcap))
        scale = 1.0
    else:
        scale = qk_scale  # applied below in one FMA with the max's subtraction (qk_scale > 0: same max)
    if MASKED:
        visible = n[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible = visible & ((pos[:, None] - n[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = m_new
    p = tl.exp2(s * scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _kv_tile(KV + s_kvkv, base, VN, rows, s_vnt, n, ctx, seq_len, v_scale, d, dmask, SRC, MASKED, HAS_VS, PAD_D)
    if SCALE_P:
        p = p * v_scale
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, lo, hi, pos, seq_len, qk_scale, k_scale, v_scale,
    softcap, window, d, dmask,
    s_kvb, s_kvkv, s_kvt, s_knt, s_vnt,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SRC: tl.constexpr, HAS_KS: tl.constexpr,
    HAS_VS: tl.constexpr, SCALE_P: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Keys [lo, hi) (lo a multiple of BLOCK_N) from the source SRC: a loop of tiles (software-pipelined), or for
    the STRADDLE tile (at most one) a branch, which keeps its pool-and-step loads out of the pipeline's buffers."""
    if SRC == STRADDLE:
        if lo < hi:
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx,
                                         tl.multiple_of(lo, BLOCK_N), pos, seq_len, qk_scale, k_scale, v_scale,
                                         softcap, window, d, dmask, s_kvb, s_kvkv, s_kvt, s_knt, s_vnt, BS, BLOCK_N,
                                         MASKED, SRC, HAS_KS, HAS_VS, SCALE_P, HAS_WINDOW, HAS_SOFTCAP, PAD_D,
                                         PRECISION)
    else:
        for n0 in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx,
                                         tl.multiple_of(n0, BLOCK_N), pos, seq_len, qk_scale, k_scale, v_scale,
                                         softcap, window, d, dmask, s_kvb, s_kvkv, s_kvt, s_knt, s_vnt, BS, BLOCK_N,
                                         MASKED, SRC, HAS_KS, HAS_VS, SCALE_P, HAS_WINDOW, HAS_SOFTCAP, PAD_D,
                                         PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_split(
    acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, lo, hi, pos, seq_len, qk_pool, qk_new, k_scale,
    v_scale, softcap, window, d, dmask,
    s_kvb, s_kvkv, s_kvt, s_knt, s_vnt,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_NEW: tl.constexpr, HAS_KS: tl.constexpr,
    HAS_VS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PAD_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys [lo, hi) (lo a multiple of BLOCK_N). With HAS_NEW, the whole tiles below ctx come from the pool, the
    tile holding ctx (if ctx is not a multiple of BLOCK_N) from both, the tiles above from the step's K/V."""
    if HAS_NEW:
        c_lo = tl.minimum(tl.maximum((ctx // BLOCK_N) * BLOCK_N, lo), hi)
        c_hi = tl.minimum(tl.maximum(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, lo), hi)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, lo, c_lo, pos,
                                      seq_len, qk_pool, k_scale, v_scale, softcap, window, d, dmask, s_kvb, s_kvkv,
                                      s_kvt, s_knt, s_vnt, BS, BLOCK_N, MASKED, POOL, HAS_KS, HAS_VS, HAS_VS,
                                      HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, c_lo, c_hi, pos,
                                      seq_len, qk_new, k_scale, v_scale, softcap, window, d, dmask, s_kvb, s_kvkv,
                                      s_kvt, s_knt, s_vnt, BS, BLOCK_N, MASKED, STRADDLE, HAS_KS, HAS_VS, False,
                                      HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, c_hi, hi, pos,
                                      seq_len, qk_new, k_scale, v_scale, softcap, window, d, dmask, s_kvb, s_kvkv,
                                      s_kvt, s_knt, s_vnt, BS, BLOCK_N, MASKED, NEW, HAS_KS, HAS_VS, False,
                                      HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    else:
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, KN, VN, new_row0, ctx, lo, hi, pos,
                                      seq_len, qk_pool, k_scale, v_scale, softcap, window, d, dmask, s_kvb, s_kvkv,
                                      s_kvt, s_knt, s_vnt, BS, BLOCK_N, MASKED, POOL, HAS_KS, HAS_VS, False,
                                      HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=VARYING_PREFILL, do_not_specialize_on_alignment=PREFILL_METADATA_PTRS)
def _prefill_kernel(
    Q, KV, KN, VN, Out, BT, SL, QSL, TILES, KS, VS,
    s_qt, s_qh, s_ot, s_oh,
    s_kvb, s_kvkv, s_kvt, s_kvh,
    s_knt, s_knh, s_vnt, s_vnh,
    s_btb,
    sm_scale, softcap, window,
    G: tl.constexpr, G_PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, HAS_NEW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PACK
    SUB: tl.constexpr = TILE // BLOCK_Q
    PAD_D: tl.constexpr = BLOCK_D != D
    hp = tl.program_id(0)  # head groups vary fastest: the longest tiles of every head group start first
    pid = tl.program_id(1)
    entry = pid // SUB
    seq = tl.load(TILES + 2 * entry)
    if seq < 0:
        return
    m0 = tl.load(TILES + 2 * entry + 1) + (pid % SUB) * BLOCK_Q
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    if m0 >= q_len:
        return
    seq_len = tl.load(SL + seq)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = m0 + r // G_PACK
    head = hp * G_PACK + r % G_PACK
    kv_head = (hp * G_PACK) // G
    row_ok = tok < q_len
    pos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_row[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    # pool tiles fold k_scale into the softmax scale; the step's own (unquantized) K does not
    qk_pool = sm_scale
    k_scale = 1.0
    v_scale = 1.0
    if HAS_KS:
        k_scale = tl.load(KS)
        qk_pool = qk_pool * k_scale
    if HAS_VS:
        v_scale = tl.load(VS)
    qk_new = sm_scale
    if not HAS_SOFTCAP:
        qk_pool = qk_pool * 1.4426950408889634  # exp2 below
        qk_new = qk_new * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    p_min = ctx + m0
    p_max = ctx + tl.minimum(m0 + BLOCK_Q, q_len) - 1
    hi = p_max + 1
    diag = ((p_min + 1) // BLOCK_N) * BLOCK_N  # blocks below see no key past any row's position
    bt_row = BT + seq * s_btb
    kv_off = kv_head * s_kvh
    kn = KN + kv_head * s_knh  # the step's key of position n >= ctx is row q_start + n - ctx
    vn = VN + kv_head * s_vnh
    new_row0 = q_start - ctx
    full_lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(p_min - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.maximum(p_max - window + 1, 0), BLOCK_N) * BLOCK_N, diag)
        acc, l_i, m_i = _attend_split(acc, l_i, m_i, q, KV, bt_row, kv_off, kn, vn, new_row0, ctx, lo, full_lo, pos,
                                      seq_len, qk_pool, qk_new, k_scale, v_scale, softcap, window, d, dmask, s_kvb,
                                      s_kvkv, s_kvt, s_knt, s_vnt, BS, BLOCK_N, True, HAS_NEW, HAS_KS, HAS_VS,
                                      HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    acc, l_i, m_i = _attend_split(acc, l_i, m_i, q, KV, bt_row, kv_off, kn, vn, new_row0, ctx, full_lo, diag, pos,
                                  seq_len, qk_pool, qk_new, k_scale, v_scale, softcap, window, d, dmask, s_kvb,
                                  s_kvkv, s_kvt, s_knt, s_vnt, BS, BLOCK_N, False, HAS_NEW, HAS_KS, HAS_VS,
                                  HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    acc, l_i, m_i = _attend_split(acc, l_i, m_i, q, KV, bt_row, kv_off, kn, vn, new_row0, ctx, diag, hi, pos,
                                  seq_len, qk_pool, qk_new, k_scale, v_scale, softcap, window, d, dmask, s_kvb,
                                  s_kvkv, s_kvt, s_knt, s_vnt, BS, BLOCK_N, True, HAS_NEW, HAS_KS, HAS_VS,
                                  HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if HAS_VS and not HAS_NEW:  # with HAS_NEW, pool tiles scaled their p instead
        out = out * v_scale
    tl.store(Out + q_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


def _check_inputs(q: torch.Tensor, kv_layer: torch.Tensor, k_new: torch.Tensor | None,
                  v_new: torch.Tensor | None) -> None:
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("q and the pool need a contiguous head dimension")
    if q.shape[1] % kv_layer.shape[3] or q.shape[2] != kv_layer.shape[4]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a pool of {kv_layer.shape[3]} KV heads x {kv_layer.shape[4]}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together")
    if k_new is not None:
        want = (q.shape[0], kv_layer.shape[3], q.shape[2])
        for x in (k_new, v_new):
            if tuple(x.shape) != want or x.dtype != q.dtype or x.stride(-1) != 1:
                raise ValueError(f"k_new/v_new need shape {want}, q's dtype {q.dtype} and a contiguous head "
                                 f"dimension; got {tuple(x.shape)} {x.dtype} strides {x.stride()}")


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # tile rows (queries x packed heads)
    block_n: int  # keys per inner step
    g_pack: int  # query heads of one KV group per tile (a power of 2 dividing the group size)
    num_warps: int
    num_stages: int


# Candidate (block_m, block_n, num_warps, num_stages) for d <= 128 that the benchmark's --sweep times on the GPU;
# none spills on sm_90 (benchmarks/attention/kernel_resources.py). The best of a run becomes prefill_config's choice.
SWEEP = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 5), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 8, 4), (128, 32, 8, 6),
         (64, 64, 4, 3), (64, 32, 4, 4))


def default_g_pack(group: int, block_m: int) -> int:
    """The largest power of 2 dividing the GQA group size that leaves at least 16 query tokens per tile."""
    p = 1
    while group % (2 * p) == 0 and block_m // (2 * p) >= 16:
        p *= 2
    return p


def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0] if torch.cuda.is_available() else 0


def prefill_config(head_dim: int, group: int, dtype: torch.dtype, device: torch.device) -> PrefillConfig:
    """Tile sizes by head dim and dtype. On sm_90 (ptxas -v, benchmarks/attention/kernel_resources.py) these use
    158-190 registers with 8 warps and no spills (up to 255 with k_new/v_new and 5 stages, still no spills, 192 KiB
    of shared memory); 4 warps at 128 rows spill, d=256 needs 64-row tiles."""
    if device.type != "cuda":  # the interpreter: small tiles keep CPU tests fast
        return PrefillConfig(32, 16, default_g_pack(group, 32), 4, 1)
    if (path := envs.prefill_config_file()) and dtype != torch.float32 and head_dim <= 128:
        return load_prefill_config(path, group)
    if dtype == torch.float32:
        bm, bn, warps, stages = (64, 32, 8, 2) if head_dim <= 128 else (64, 16, 8, 2)  # spills a little: tests only
    elif head_dim <= 128:  # 5 stages (129 KiB of shared memory) on Hopper: the best of the sweep on an H200
        # (benchmarks/lease_s9/attn: 1.20x the 3-stage kernel's speed over 8k and 32k prompts and a 512 chunk)
        bm, bn, warps, stages = 128, 64, 8, (5 if _capability_major(device) >= 9 else 3)
    else:
        bm, bn, warps, stages = 64, 32, 8, 3
    return PrefillConfig(bm, bn, default_g_pack(group, bm), warps, stages)


def load_prefill_config(path: str, group: int) -> PrefillConfig:
    """A tile choice from a JSON file ({block_m, block_n, num_warps, num_stages[, g_pack]}: what
    `bench_attention.py --sweep --best-out` writes); g_pack is fitted to this model's group size."""
    with open(path) as f:
        d = json.load(f)
    bm = int(d["block_m"])
    pack = int(d.get("g_pack") or default_g_pack(group, bm))
    if group % pack or bm % pack:
        pack = default_g_pack(group, bm)
    return PrefillConfig(bm, int(d["block_n"]), pack, int(d["num_warps"]), int(d["num_stages"]))


def paged_prefill(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, prefill_tiles: torch.Tensor, scale: float,
                  sliding_window: int | None = None, softcap: float | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: PrefillConfig | None = None,
                  k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the rows listed in `prefill_tiles` ([n, 2] int32: row, first new token; see metadata.py).

    q [T, Hq, D] (token and head strides free, D contiguous); kv_layer [num_blocks, 2, block_size, Hk, D];
    block_tables [B, W], seq_lens [B], query_start_loc [B+1] int32 on device. Writes the output rows of those
    tokens into `out` ([T, Hq, D], allocated if not given; other rows are left as they are).

    k_new/v_new ([T, Hk, D], q's dtype and token rows, D contiguous): the step's own K/V, already written into the
    pool. When given, the keys of each row's new tokens are read from them instead of the pool (no fp8 widening,
    and exact: an fp8 pool's copy is quantized); the prefix before them still comes from the pool.
    """
    _, hq, d = q.shape
    bs, hk = kv_layer.shape[2], kv_layer.shape[3]
    g = hq // hk
    _check_inputs(q, kv_layer, k_new, v_new)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    n_tiles = prefill_tiles.shape[0]
    if n_tiles == 0:
        return out
    cfg = config or prefill_config(d, g, q.dtype, q.device)
    if g % cfg.g_pack or cfg.block_m % cfg.g_pack or PREFILL_TILE % (cfg.block_m // cfg.g_pack):
        raise ValueError(f"prefill config {cfg} does not fit group size {g} and tile {PREFILL_TILE}")
    fp8 = is_fp8(kv_layer.dtype)
    has_ks, has_vs = fp8 and k_scale is not None, fp8 and v_scale is not None
    sub = PREFILL_TILE // (cfg.block_m // cfg.g_pack)
    if n_tiles * sub > 65535:
        raise ValueError(f"{n_tiles} prefill tiles of {PREFILL_TILE} tokens exceed one launch's grid; schedule fewer "
                         "tokens a step (--max-num-batched-tokens)")
    has_new = k_new is not None
    kn, vn = (k_new, v_new) if has_new else (q, q)  # q: never read without HAS_NEW
    _prefill_kernel[(hq // cfg.g_pack, n_tiles * sub)](
        q, kv_layer, kn, vn, out, block_tables, seq_lens, query_start_loc, prefill_tiles,
        k_scale if has_ks else seq_lens, v_scale if has_vs else seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        block_tables.stride(0),
        scale, softcap or 1.0, sliding_window or 0,
        G=g, G_PACK=cfg.g_pack, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, BLOCK_D=triton.next_power_of_2(d),
        BS=bs, TILE=PREFILL_TILE, HAS_WINDOW=bool(sliding_window), HAS_SOFTCAP=softcap is not None,
        HAS_KS=has_ks, HAS_VS=has_vs, HAS_NEW=has_new, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out

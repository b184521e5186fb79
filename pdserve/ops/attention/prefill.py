"""Varlen paged prefill attention (FlashAttention-2 style) reading K/V straight from the block-major pool.

One launch covers every row of a step with more than one new token: whole prompts and chunks on a prefix already
in the pool. Program (p, hp) takes entry p // SUB of the tile table (see metadata.py) and its (p % SUB)-th part of
BLOCK_Q queries, and the query heads hp * G_PACK ... (G_PACK query heads of one KV group share every K/V tile load:
a tile has BLOCK_M = BLOCK_Q * G_PACK rows). Online softmax over BLOCK_N keys at a time, exp2 with the scale
folded in, fp32 accumulation. Causal with the query offset (KV length - new tokens) and optional sliding window; the
key range splits into up to three loops so only the blocks at the window edge and on the diagonal pay for masks.
fp8 pools are widened in registers (k_scale folds into the softmax scale, v_scale into the output); softcapping is
applied to the scaled scores (Gemma 2 style).
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


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, KV, bt_row, kv_off, lo, hi, pos, seq_len, qk_scale, softcap, window, d, dmask,
    s_kvb, s_kvkv, s_kvt,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            page = tl.load(bt_row + n // BS, mask=n < seq_len, other=0)
        else:
            page = tl.load(bt_row + n // BS)
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + kv_off
        if PAD_D:
            k = tl.load(KV + base[:, None] + d[None, :], mask=dmask[None, :], other=0.0)
        else:
            k = tl.load(KV + base[:, None] + d[None, :])
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
        if PAD_D:
            v = tl.load(KV + s_kvkv + base[:, None] + d[None, :], mask=dmask[None, :], other=0.0)
        else:
            v = tl.load(KV + s_kvkv + base[:, None] + d[None, :])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=VARYING_PREFILL, do_not_specialize_on_alignment=PREFILL_METADATA_PTRS)
def _prefill_kernel(
    Q, KV, Out, BT, SL, QSL, TILES, KS, VS,
    s_qt, s_qh, s_ot, s_oh,
    s_kvb, s_kvkv, s_kvt, s_kvh,
    s_btb,
    sm_scale, softcap, window,
    G: tl.constexpr, G_PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, PRECISION: tl.constexpr,
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
    qk_scale = sm_scale
    if HAS_KS:
        qk_scale = qk_scale * tl.load(KS)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * 1.4426950408889634  # exp2 below
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    p_min = ctx + m0
    p_max = ctx + tl.minimum(m0 + BLOCK_Q, q_len) - 1
    hi = p_max + 1
    diag = ((p_min + 1) // BLOCK_N) * BLOCK_N  # blocks below see no key past any row's position
    bt_row = BT + seq * s_btb
    kv_off = kv_head * s_kvh
    full_lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(p_min - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.maximum(p_max - window + 1, 0), BLOCK_N) * BLOCK_N, diag)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, lo, full_lo, pos, seq_len, qk_scale,
                                      softcap, window, d, dmask, s_kvb, s_kvkv, s_kvt, BS, BLOCK_N, True,
                                      HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, full_lo, diag, pos, seq_len, qk_scale,
                                  softcap, window, d, dmask, s_kvb, s_kvkv, s_kvt, BS, BLOCK_N, False,
                                  HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, KV, bt_row, kv_off, diag, hi, pos, seq_len, qk_scale,
                                  softcap, window, d, dmask, s_kvb, s_kvkv, s_kvt, BS, BLOCK_N, True,
                                  HAS_WINDOW, HAS_SOFTCAP, PAD_D, PRECISION)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if HAS_VS:
        out = out * tl.load(VS)
    tl.store(Out + q_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


def _check_inputs(q: torch.Tensor, kv_layer: torch.Tensor) -> None:
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("q and the pool need a contiguous head dimension")
    if q.shape[1] % kv_layer.shape[3] or q.shape[2] != kv_layer.shape[4]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a pool of {kv_layer.shape[3]} KV heads x {kv_layer.shape[4]}")


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
    158-190 registers with 8 warps and no spills; 4 warps at 128 rows spill, d=256 needs 64-row tiles."""
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
                  out: torch.Tensor | None = None, config: PrefillConfig | None = None) -> torch.Tensor:
    """Attention of the rows listed in `prefill_tiles` ([n, 2] int32: row, first new token; see metadata.py).

    q [T, Hq, D] (token and head strides free, D contiguous); kv_layer [num_blocks, 2, block_size, Hk, D];
    block_tables [B, W], seq_lens [B], query_start_loc [B+1] int32 on device. Writes the output rows of those
    tokens into `out` ([T, Hq, D], allocated if not given; other rows are left as they are).
    """
    _, hq, d = q.shape
    bs, hk = kv_layer.shape[2], kv_layer.shape[3]
    g = hq // hk
    _check_inputs(q, kv_layer)
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
    _prefill_kernel[(hq // cfg.g_pack, n_tiles * sub)](
        q, kv_layer, out, block_tables, seq_lens, query_start_loc, prefill_tiles,
        k_scale if has_ks else seq_lens, v_scale if has_vs else seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        scale, softcap or 1.0, sliding_window or 0,
        G=g, G_PACK=cfg.g_pack, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, BLOCK_D=triton.next_power_of_2(d),
        BS=bs, TILE=PREFILL_TILE, HAS_WINDOW=bool(sliding_window), HAS_SOFTCAP=softcap is not None,
        HAS_KS=has_ks, HAS_VS=has_vs, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out

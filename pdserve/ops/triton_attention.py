"""Triton paged attention for CUDA: a split-K decode kernel that reads each sequence's KV straight from the
block-major pool through its block table (no gather copies), one program per (sequence, KV head, split) with the
query heads of a GQA group packed together, and a small kernel that merges the splits. Prefill sequences of a
mixed batch use torch's SDPA on their gathered KV (one call per sequence), which is compute-bound anyway.

Registers itself as the "triton" attention backend; the torch backend stays the oracle in tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    _gather_seq,
    is_fp8,
    register_backend,
    write_kv,
)


@triton.jit
def _decode_split_kernel(
    Q, KV, BT, SL, PartO, PartM, PartL,
    s_qb, s_qh,
    s_kvb, s_kvkv, s_kvt, s_kvh,
    s_btb,
    s_pb, s_ph, s_ps,
    scale, window, tokens_per_split,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(SL + b)
    start = sp * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if window > 0:
        start = tl.maximum(start, seq_len - window)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    q = tl.load(Q + b * s_qb + (hk * G + g)[:, None] * s_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    lo = (start // BLOCK_N) * BLOCK_N
    for n0 in range(lo, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = (n >= start) & (n < end)
        page = tl.load(BT + b * s_btb + n // BS, mask=valid, other=0)
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + hk * s_kvh
        k = tl.load(KV + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(KV + s_kvkv + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    h = hk * G + g
    po = PartO + b * s_pb + h[:, None] * s_ph + sp * s_ps + d[None, :]
    tl.store(po, acc, mask=gmask[:, None])
    pm = b * (s_pb // D) + h * (s_ph // D) + sp
    tl.store(PartM + pm, m_i, mask=gmask)
    tl.store(PartL + pm, l_i, mask=gmask)


@triton.jit
def _merge_kernel(PartO, PartM, PartL, Out, s_pb, s_ph, s_ps, s_ob, s_oh, num_splits,
                  D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sidx = tl.arange(0, BLOCK_S)
    smask = sidx < num_splits
    pm = b * (s_pb // D) + h * (s_ph // D) + sidx
    m = tl.load(PartM + pm, mask=smask, other=float("-inf"))
    lse = tl.load(PartL + pm, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    denom = tl.sum(w * lse, 0)
    d = tl.arange(0, D)
    o = tl.load(PartO + b * s_pb + h * s_ph + sidx[:, None] * s_ps + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(Out + b * s_ob + h * s_oh + d, out.to(Out.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (tests on CPU)
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 max_seq_len: int, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; kv_layer [num_blocks, 2, block_size, Hk, D] (any strides with D contiguous) -> [B, Hq, D]."""
    b, hq, d = q.shape
    bs, hk = kv_layer.shape[2], kv_layer.shape[3]
    g = hq // hk
    block_n = 64 if bs <= 64 else bs
    span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    want = max(1, (2 * _num_sms(q.device)) // max(1, b * hk))
    num_splits = max(1, min(want, triton.cdiv(span, 256), 64))
    tps = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, tps)
    part_o = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    part_m = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _decode_split_kernel[(b, hk, num_splits)](
        q, kv_layer, block_tables, seq_lens, part_o, part_m, part_l,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        scale, sliding_window or 0, tps,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BS=bs, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    out = torch.empty_like(q)
    _merge_kernel[(b, hq)](part_o, part_m, part_l, out, part_o.stride(0), part_o.stride(1), part_o.stride(2),
                           out.stride(0), out.stride(1), num_splits, D=d,
                           BLOCK_S=max(2, triton.next_power_of_2(num_splits)))
    return out


class TritonAttentionBackend:
    name = "triton"

    def __init__(self):
        self._ref = TorchAttentionBackend()

    def forward(self, q, k, v, kv_layer, meta: AttentionMetadata, scale, sliding_window=None, softcap=None,
                k_scale=None, v_scale=None):
        if softcap is not None or q.device.type != "cuda" or is_fp8(kv_layer):  # fp8 pools: the reference for now
            return self._ref.forward(q, k, v, kv_layer, meta, scale, sliding_window, softcap, k_scale, v_scale)
        write_kv(kv_layer, k, v, meta.slot_mapping)
        if meta.decode_only:
            return paged_decode(q, kv_layer, meta.block_tables, meta.seq_lens_t, meta.max_seq_len, scale,
                                sliding_window)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc
        dec = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        if dec:
            rows = torch.tensor([qsl[i] for i in dec], device=q.device)
            sel = torch.tensor(dec, device=q.device)
            lens = meta.seq_lens_t.index_select(0, sel)
            out[rows] = paged_decode(q.index_select(0, rows), kv_layer, meta.block_tables.index_select(0, sel), lens,
                                     max(meta.seq_lens[i] for i in dec), scale, sliding_window)
        for i, seq_len in enumerate(meta.seq_lens):
            qs, qe = qsl[i], qsl[i + 1]
            if qe - qs == 1:
                continue
            ks, vs = _gather_seq(kv_layer, meta.block_tables[i], seq_len)
            n = qe - qs
            qh = q[qs:qe].transpose(0, 1).unsqueeze(0)
            kh = ks.transpose(0, 1).unsqueeze(0)
            vh = vs.transpose(0, 1).unsqueeze(0)
            if n == seq_len and not sliding_window:
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                                     enable_gqa=True)
            else:
                q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
                k_pos = torch.arange(seq_len, device=q.device)
                mask = k_pos[None, :] <= q_pos[:, None]
                if sliding_window:
                    mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                                                     enable_gqa=True)
            out[qs:qe] = o[0].transpose(0, 1)
        return out


register_backend("triton", TritonAttentionBackend)

"""The torch reference backend: exact, simple, the oracle every kernel is tested against.

It handles mixed batches of prefill chunks and decodes, prefix hits (KV already in the pool), sliding windows,
softcapping and fp8 pools (stored = x / scale saturated to the fp8 range; read = stored * scale, after the gather).
As the Triton backend does, rows with more than one new token attend to their new tokens' K/V as computed (the
forward's k and v), the prefix as stored; decode rows read everything from the pool. The two differ only for fp8
pools (the pool's copy is quantized). One gather per sequence (decode-only batches in one shot); not fast and not
for CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.ops.attention.common import as_storage, fp8_max, is_fp8
from pdserve.ops.attention.metadata import AttentionMetadata

_SCORES_PER_CALL = 1 << 28  # query x key x head scores one attention call may materialize


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale in fp32, saturated to the fp8 range, rounded to `dtype` (nearest even)."""
    y = x.float()
    if scale is not None:
        y = y / scale.float()
    m = fp8_max(dtype)
    return y.clamp(-m, m).to(dtype)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter new K/V ([T, Hk, D]) into one layer's view `[num_blocks, 2, block_size, Hk, D]` at
    `slot = block * block_size + offset`; slots < 0 are skipped; fp8 pools store x / scale."""
    t = min(slot_mapping.shape[0], k.shape[0])  # a padded slot mapping may be longer than the real rows
    keep = slot_mapping[:t] >= 0
    slots = slot_mapping[:t][keep]
    k, v = k[:t][keep], v[:t][keep]
    if is_fp8(kv_layer.dtype):
        k = quantize_fp8(k, kv_layer.dtype, k_scale)
        v = quantize_fp8(v, kv_layer.dtype, v_scale)
    else:
        k, v = k.to(kv_layer.dtype), v.to(kv_layer.dtype)
    bs = kv_layer.shape[2]
    blk, off = slots // bs, slots % bs
    pool = as_storage(kv_layer)
    pool[blk, 0, off] = as_storage(k)
    pool[blk, 1, off] = as_storage(v)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Pool values in `dtype`: fp8 values are multiplied by their scale in fp32 first."""
    if is_fp8(x.dtype):
        y = x.float()
        if scale is not None:
            y = y * scale.float()
        return y.to(dtype)
    return x.to(dtype)


def gather_seq(kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([seq_len, Hk, D], pool dtype) of one sequence, copied out of its blocks."""
    bs = kv_layer.shape[2]
    nb = (seq_len + bs - 1) // bs
    blocks = as_storage(kv_layer)[block_table[:nb].long()].view(kv_layer.dtype)  # [nb, 2, bs, Hk, D]
    k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:seq_len]
    v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:seq_len]
    return k, v


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    m = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        m &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return m


def _attend(q, k, v, mask, scale, softcap):
    """q [Hq, Q, D], k/v [Hk, S, D], mask [Q, S] bool -> [Q, Hq, D]."""
    hq, hk = q.shape[0], k.shape[0]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=0)
        v = v.repeat_interleave(hq // hk, dim=0)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return out.transpose(0, 1)


class TorchAttentionBackend:
    """Reference paged attention (see the module docstring)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,
        kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, Hk, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv(kv_layer, k, v, meta.slot_mapping, k_scale, v_scale)
        return self.attend(q, kv_layer, meta, scale, sliding_window, softcap, k_scale, v_scale, k_new=k, v_new=v)

    def attend(self, q, kv_layer, meta: AttentionMetadata, scale, sliding_window=None, softcap=None, k_scale=None,
               v_scale=None, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the pool as it is (no write). Rows of `q` past the metadata's tokens come back zero.
        k_new/v_new ([T, Hk, D], q's token rows): the new tokens' K/V of rows with more than one new token (see
        the module docstring); without them every key comes from the pool."""
        if not is_fp8(kv_layer.dtype):
            k_scale = v_scale = None
        if meta.decode_only and softcap is None:
            out = torch.zeros_like(q)
            out[: meta.num_seqs] = self._decode_batched(q[: meta.num_seqs], kv_layer, meta, scale, sliding_window,
                                                        k_scale, v_scale)
            return out
        out = torch.zeros_like(q)
        qsl = meta.query_start_loc
        for i, seq_len in enumerate(meta.seq_lens):
            qs, qe = qsl[i], qsl[i + 1]
            if qe == qs:
                continue
            ks, vs = gather_seq(kv_layer, meta.block_tables[i], seq_len)
            ks, vs = dequantize(ks, q.dtype, k_scale), dequantize(vs, q.dtype, v_scale)
            if k_new is not None and qe - qs > 1:
                ctx = seq_len - (qe - qs)
                ks = torch.cat([ks[:ctx], k_new[qs:qe].to(q.dtype)])
                vs = torch.cat([vs[:ctx], v_new[qs:qe].to(q.dtype)])
            k_pos = torch.arange(seq_len, device=q.device)
            kt, vt = ks.transpose(0, 1), vs.transpose(0, 1)
            step = max(1, _SCORES_PER_CALL // (seq_len * q.shape[1]))  # bounds the score matrix of long prompts
            for c in range(qs, qe, step):
                ce = min(c + step, qe)
                q_pos = torch.arange(seq_len - (qe - c), seq_len - (qe - ce), device=q.device)
                mask = _mask(q_pos, k_pos, sliding_window)
                out[c:ce] = _attend(q[c:ce].transpose(0, 1), kt, vt, mask, scale, softcap)
        return out

    @staticmethod
    def _decode_batched(q, kv_layer, meta, scale, sliding_window, k_scale=None, v_scale=None):
        bs = kv_layer.shape[2]
        b = meta.num_seqs
        nb = (max(meta.seq_lens, default=1) + bs - 1) // bs
        bt = meta.block_tables[:b, :nb].long().clamp_min(0)
        blocks = as_storage(kv_layer)[bt].view(kv_layer.dtype)  # [B, nb, 2, bs, Hk, D]
        hk, d = blocks.shape[-2], blocks.shape[-1]
        k = dequantize(blocks[:, :, 0], q.dtype, k_scale).reshape(b, nb * bs, hk, d).transpose(1, 2)  # [B, Hk, S, D]
        v = dequantize(blocks[:, :, 1], q.dtype, v_scale).reshape(b, nb * bs, hk, d).transpose(1, 2)
        seq_lens = torch.tensor(meta.seq_lens, device=q.device)
        k_pos = torch.arange(nb * bs, device=q.device)
        mask = k_pos[None, :] < seq_lens[:, None]
        if sliding_window is not None:
            mask &= (seq_lens[:, None] - 1 - k_pos[None, :]) < sliding_window
        hq = q.shape[1]
        if hq != hk:
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale)
        return out.squeeze(2)

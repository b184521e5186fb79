"""Paged attention behind one small interface, with a torch reference implementation.

The KV pool is one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (block-major, so a
block is one contiguous run of bytes for the transfer engine). Kernels see one layer through strides and address
tokens through each sequence's block table. The torch backend here is the oracle for faster kernels: it handles
mixed batches of prefill chunks and decodes, prefix hits (KV already in the pool) and sliding windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each sequence of a flattened batch reads and writes KV. Built once per step by the runner."""

    query_start_loc: list[int]  # [B+1] offsets of each sequence's new tokens in the flat batch
    seq_lens: list[int]  # [B] KV length of each sequence after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32 on device, -1 padded
    slot_mapping: torch.Tensor  # [T] int64 on device: block_id * block_size + offset of each new token
    max_seq_len: int
    decode_only: bool  # every sequence has exactly one new token
    seq_lens_t: torch.Tensor | None = None  # [B] int32 on device (kernels)
    query_start_loc_t: torch.Tensor | None = None  # [B+1] int32 on device (kernels)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def is_fp8(kv_layer: torch.Tensor) -> bool:
    return kv_layer.element_size() == 1


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors are indexed as uint8 (the same bytes), which every device supports."""
    return t.view(torch.uint8) if is_fp8(t) else t


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter new K/V ([T, H, D]) into one layer's view `[num_blocks, 2, block_size, H, D]`; an fp8 pool stores
    k / k_scale and v / v_scale."""
    block_size = kv_layer.shape[2]
    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    if is_fp8(kv_layer):
        k = k.float() / k_scale if k_scale is not None else k
        v = v.float() / v_scale if v_scale is not None else v
    _bytes(kv_layer)[blk, 0, off] = _bytes(k.to(kv_layer.dtype))
    _bytes(kv_layer)[blk, 1, off] = _bytes(v.to(kv_layer.dtype))


def dequant(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """K or V read from the pool in the query's dtype (times the scale of an fp8 pool)."""
    if is_fp8(x):
        x = x.to(dtype)
        return x * scale if scale is not None else x
    return x


def _gather_seq(kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = kv_layer.shape[2]
    nb = (seq_len + block_size - 1) // block_size
    blocks = _bytes(kv_layer)[block_table[:nb].long()].view(kv_layer.dtype)  # [nb, 2, bs, H, D]
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
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    else:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return out.transpose(0, 1)


class TorchAttentionBackend:
    """Reference paged attention: exact, simple, one gather per sequence (decode batches in one shot)."""

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
        if meta.decode_only and softcap is None:
            return self._decode_batched(q, kv_layer, meta, scale, sliding_window, k_scale, v_scale)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc
        for i, seq_len in enumerate(meta.seq_lens):
            qs, qe = qsl[i], qsl[i + 1]
            ks, vs = _gather_seq(kv_layer, meta.block_tables[i], seq_len)
            ks, vs = dequant(ks, q.dtype, k_scale), dequant(vs, q.dtype, v_scale)
            q_pos = torch.arange(seq_len - (qe - qs), seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = _mask(q_pos, k_pos, sliding_window)
            out[qs:qe] = _attend(q[qs:qe].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), mask, scale, softcap)
        return out

    @staticmethod
    def _decode_batched(q, kv_layer, meta, scale, sliding_window, k_scale=None, v_scale=None):
        block_size = kv_layer.shape[2]
        b = meta.num_seqs
        nb = (meta.max_seq_len + block_size - 1) // block_size
        bt = meta.block_tables[:, :nb].long().clamp_min(0)
        blocks = _bytes(kv_layer)[bt].view(kv_layer.dtype)  # [B, nb, 2, bs, Hk, D]
        hk, d = blocks.shape[-2], blocks.shape[-1]
        k = dequant(blocks[:, :, 0], q.dtype, k_scale).reshape(b, nb * block_size, hk, d).transpose(1, 2)
        v = dequant(blocks[:, :, 1], q.dtype, v_scale).reshape(b, nb * block_size, hk, d).transpose(1, 2)
        seq_lens = torch.tensor(meta.seq_lens, device=q.device)
        k_pos = torch.arange(nb * block_size, device=q.device)
        mask = k_pos[None, :] < seq_lens[:, None]
        if sliding_window is not None:
            mask &= (seq_lens[:, None] - 1 - k_pos[None, :]) < sliding_window
        qh = q.unsqueeze(2)  # [B, Hq, 1, D]
        hq = q.shape[1]
        if hq != hk:
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
        out = F.scaled_dot_product_attention(qh, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale)
        return out.squeeze(2)


_BACKENDS: dict[str, type] = {"torch": TorchAttentionBackend}


def register_backend(name: str, cls: type) -> None:
    _BACKENDS[name] = cls


def get_backend(name: str, device: torch.device):
    """Pick an attention backend by name; `auto` prefers the Triton kernels on CUDA when they import."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                from pdserve.ops import triton_attention  # noqa: F401  (registers "triton")

                name = "triton"
            except Exception:  # triton missing or broken: the reference still works
                name = "torch"
    if name == "triton":
        from pdserve.ops import triton_attention  # noqa: F401
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()

"""The Triton attention backend: KV write, split-K decode and varlen paged prefill, all reading the pool in place.

forward() writes the step's K/V (quantizing for fp8 pools; unless the model's rotary kernel already did:
`writes_kv_early`), then runs the decode kernel over the rows with one new
token and the prefill kernel over the tile table of the others (each launched only when the step can have such
rows); the prefill kernel reads the new tokens' K/V from the step's k and v rather than the pool (prefill.py says
why). Every launch size comes from tensor shapes and host ints fixed for a padded batch (token count, row count,
tile-table length, the KV-length bound in `max_seq_len`); per-row lengths and offsets are read on the device. So
forward is capturable in a CUDA graph when the metadata comes from `AttentionMetadataBuilder` (static buffers).

A step whose prefill rows are all long runs them through cuDNN's fused attention instead (library_prefill.py:
which rows, and the measurements that chose them); that choice is made on the host from the step's row lengths,
so it happens only where attention runs eagerly (piecewise graphs, eager steps), never in a full decode graph.
"""

from __future__ import annotations

import torch

from pdserve.ops.attention.common import KVTarget, QKRope
from pdserve.ops.attention.decode import decode_splits, paged_decode, rope_in_decode
from pdserve.ops.attention.kv_write import write_kv
from pdserve.ops.attention.library_prefill import library_prefill, library_rows
from pdserve.ops.attention.metadata import AttentionMetadata
from pdserve.ops.attention.prefill import PrefillConfig, paged_prefill
from pdserve.ops.rotary import qk_norm_rope


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True  # decode-only and mixed steps, with builder-made (static) metadata
    read_new_kv = True  # prefill rows read their new tokens' K/V from k/v; False: all from the pool (benchmark A/B)
    # the model's rotary kernel may write the step's K/V into the pool (pdserve.model.forward_context.kv_target):
    # forward(kv_written=True) then skips write_kv (one kernel a layer less; False: an A/B in bench_steps.py)
    writes_kv_early = True

    def __init__(self, prefill_config: PrefillConfig | None = None):
        self.prefill_config = prefill_config  # None: chosen per head dim and dtype (prefill.prefill_config)

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
        kv_written: bool = False,
        rope: QKRope | None = None,
    ) -> torch.Tensor:
        """With `rope` (only where folds_rope said yes), q/k/v are the q/k/v product's output: the decode kernel
        applies the QK-norm and rotary and writes the K/V itself, or, for a launch it does not take them in
        (decode.rope_in_decode), the rotary kernel does before it."""
        meta.ensure_device(q.device)
        if rope is not None:
            b = meta.seq_lens_t.shape[0]
            hk = kv_layer.shape[3]
            splits = decode_splits(b, hk, meta.max_seq_len, sliding_window, q.device)
            if rope_in_decode(q, kv_layer, rope, b * hk * splits):
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                return paged_decode(q, kv_layer, meta.block_tables, meta.seq_lens_t, meta.max_seq_len, scale,
                                    sliding_window=sliding_window, softcap=softcap, k_scale=k_scale,
                                    v_scale=v_scale, out=out, num_splits=splits, rope=rope, k=k, v=v,
                                    slot_mapping=meta.slot_mapping)
            q, k = qk_norm_rope(q, k, rope.positions, rope.cos, rope.sin, rope.q_weight, rope.k_weight, rope.eps,
                                rope.offset, v=v, kv=KVTarget(kv_layer, meta.slot_mapping, k_scale, v_scale))
            kv_written = True
        if not kv_written:
            write_kv(kv_layer, k, v, meta.slot_mapping, k_scale, v_scale)
        new = (k, v) if self.read_new_kv else (None, None)
        return self.attend(q, kv_layer, meta, scale, sliding_window, softcap, k_scale, v_scale, *new)

    def folds_rope(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, rope: QKRope) -> bool:
        """Whether forward() takes this step's QK-norm and rotary (`rope`): a decode-only step of a layer whose
        decode kernel can do them (decode.ROPE_IN_DECODE)."""
        return meta.decode_only and rope_in_decode(q, kv_layer, rope)

    def attend(self, q, kv_layer, meta: AttentionMetadata, scale, sliding_window=None, softcap=None, k_scale=None,
               v_scale=None, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the pool as it is (no write). k_new/v_new: the step's K/V rows, already in the pool,
        which prefill rows then read their new tokens' keys from (paged_prefill); None: all from the pool."""
        meta.ensure_device(q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = dict(sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale, out=out)
        if meta.decode_only:
            return paged_decode(q, kv_layer, meta.block_tables, meta.seq_lens_t, meta.max_seq_len, scale, **common)
        if meta.any_decodes():
            paged_decode(q, kv_layer, meta.block_tables, meta.seq_lens_t, meta.max_seq_len, scale,
                         query_start_loc=meta.query_start_loc_t, **common)
        rows = library_rows(meta, q, kv_layer, k_new, sliding_window, softcap)
        if rows is not None:  # every prefill row is long: cuDNN's kernel (library_prefill.py says when and why)
            library_prefill(q, kv_layer, meta, rows, scale, k_new, v_new, out, k_scale, v_scale)
            return out
        return paged_prefill(q, kv_layer, meta.block_tables, meta.seq_lens_t, meta.query_start_loc_t,
                             meta.prefill_tiles, scale, config=self.prefill_config, k_new=k_new, v_new=v_new,
                             **common)

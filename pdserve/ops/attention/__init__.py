"""Paged attention behind one small interface.

The KV pool is one tensor `[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]` (block-major, so a
block is one contiguous run of bytes for the transfer engine, and head-major inside it, so a range of heads is one
run too); a backend sees one layer's strided view `[num_blocks, 2, block_size, Hk, D]`
(pdserve.model.forward_context.layer_view) and addresses tokens through each sequence's block table:

    backend.forward(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], kv_layer, meta, scale,
                    sliding_window=None, softcap=None, k_scale=None, v_scale=None) -> [T, Hq, D]

writes k/v into the pool (quantizing for fp8 pools), then attends over the pool including the new tokens.

Modules: metadata (AttentionMetadata and its builder), torch_ref (the oracle), kv_write, decode, prefill (Triton
kernels), triton_backend, registry (backends by name, imported lazily). Importing this package imports no Triton.
"""

from pdserve.ops.attention.metadata import (
    PREFILL_TILE,
    AttentionMetadata,
    AttentionMetadataBuilder,
    max_prefill_tiles,
    pack_block_tables,
    prefill_tile_table,
)
from pdserve.ops.attention.registry import available_backends, get_backend, register_backend

__all__ = [
    "PREFILL_TILE",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "available_backends",
    "get_backend",
    "max_prefill_tiles",
    "pack_block_tables",
    "prefill_tile_table",
    "register_backend",
]

"""The per-step state attention layers read (metadata, KV pool, backend), set by the runner around a forward.

A module-level context keeps the model's forward signature the same as Hugging Face's (ids, positions) and keeps
the math free of scheduling concerns, as nano-vllm does.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pdserve.ops.attention import AttentionMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, Hk, D]
    backend: object
    after_layer: object = None  # called with the layer index once that layer's KV is written (layer-wise push)


_CTX: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CTX is None:
        raise RuntimeError("attention called outside a runner step (no forward context set)")
    return _CTX


@contextmanager
def forward_context(ctx: ForwardContext):
    global _CTX
    prev, _CTX = _CTX, ctx
    try:
        yield
    finally:
        _CTX = prev

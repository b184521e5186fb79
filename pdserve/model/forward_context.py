"""The per-step state attention layers read (metadata, KV pool, backend), set by the runner around a forward.

A module-level context keeps the model's forward signature the same as Hugging Face's (ids, positions) and keeps
the math free of scheduling concerns, as nano-vllm does. It lives with the model (the engine imports it, never the
other way round).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pdserve.ops.attention import AttentionMetadata
from pdserve.ops.attention.common import KVTarget, QKRope


@dataclass
class ForwardContext:
    meta: AttentionMetadata | None
    kv_cache: torch.Tensor  # [num_blocks, Hk, num_layers, 2, block_size, D] (engine.runner.kv_cache_shape)
    backend: object  # .forward(q, k, v, kv_layer, meta, scale, sliding_window, softcap, k_scale, v_scale)
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


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer of the pool as attention backends take it: `[num_blocks, 2, block_size, Hk, D]` (a strided view;
    the pool is `[num_blocks, Hk, num_layers, 2, block_size, D]`)."""
    return kv_cache[:, :, layer].permute(0, 2, 3, 1, 4)


def kv_target(layer) -> KVTarget | None:
    """Where the kernel before attention may write this layer's new K/V (pdserve.ops.rotary.qk_norm_rope), or None
    where the backend writes them itself: only a backend that says it skips its write for such a step
    (`writes_kv_early`, the Triton backend) with the step's metadata at hand (not a piecewise capture, whose
    stand-in backend records attention and writes the real rows' KV when it replays it)."""
    ctx = get_forward_context()
    if ctx.meta is None or not getattr(ctx.backend, "writes_kv_early", False):
        return None
    return KVTarget(layer_view(ctx.kv_cache, layer.layer_idx), ctx.meta.slot_mapping, layer.k_scale, layer.v_scale)


def rope_in_attention(q: torch.Tensor, kv: KVTarget | None, rope: QKRope) -> bool:
    """Whether this step's attention backend applies the layer's QK-norm and rotary and writes the K/V itself
    (attend(rope=...)): a backend that says so for the step (`folds_rope`: the Triton backend's decode-only steps),
    where the K/V may be written before the backend's own write (`kv`, kv_target's answer)."""
    if kv is None:
        return False
    ctx = get_forward_context()
    folds = getattr(ctx.backend, "folds_rope", None)
    return folds is not None and folds(q, kv.kv_layer, ctx.meta, rope)


def attend(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVTarget | None = None,
           rope: QKRope | None = None) -> torch.Tensor:
    """Paged attention of one layer (`layer_idx`, `scale`, `sliding_window`, `softcap`, `k_scale`, `v_scale`):
    the backend writes k/v into the layer's slice of the pool (unless `kv`, kv_target's answer: a kernel before it
    wrote them there; its pool view is reused) and attends; then the layer hook runs. With `rope` (where
    rope_in_attention said yes), q/k/v are not yet normed and rotated and the backend does that and the write."""
    ctx = get_forward_context()
    extra = {"kv_written": True} if kv is not None else {}
    if rope is not None:
        extra["rope"] = rope
    kv_layer = kv.kv_layer if kv is not None else layer_view(ctx.kv_cache, layer.layer_idx)
    o = ctx.backend.forward(q, k, v, kv_layer, ctx.meta, layer.scale, layer.sliding_window, layer.softcap,
                            k_scale=layer.k_scale, v_scale=layer.v_scale, **extra)
    if ctx.after_layer is not None:
        ctx.after_layer(layer.layer_idx)
    return o

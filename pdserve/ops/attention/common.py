"""Small facts shared by the attention modules: which pool dtypes are fp8 and how far they reach; where a step's new
K/V go (KVTarget) when a kernel before attention writes them; the QK-norm and rotary a decode launch may apply
itself (QKRope)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2): stored values saturate there."""
    return float(torch.finfo(dtype).max)


def as_storage(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors viewed as uint8 (the same bytes) so that gathers and scatters work on every device."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


@dataclass(frozen=True)
class KVTarget:
    """Where one layer's new K/V go: the layer's pool view `[num_blocks, 2, block_size, Hk, D]`, the step's slots
    (`block * block_size + offset`, < 0: skip; may be shorter than the token rows: the rest are skipped) and the fp8
    pool's per-tensor scales (None: 1)."""

    kv_layer: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class QKRope:
    """The per-head RMS norm (weights None: none, Llama) and neox rotary that a layer applies to q and k before
    attention (pdserve.ops.rotary.qk_norm_rope's arguments): the step's positions `[T]`, the float32 cos/sin caches
    `[max_positions, head_dim / 2]`, the norm's weights, eps and offset (1: Gemma's 1 + weight)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0


def check_kv_args(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, Hk, D] must match the pool's heads and have a contiguous last dimension, as the pool must."""
    hk, d = kv_layer.shape[3], kv_layer.shape[4]
    if k.shape[1:] != (hk, d) or v.shape[1:] != (hk, d):
        raise ValueError(f"k/v of shape {tuple(k.shape)}/{tuple(v.shape)} do not match the pool's heads {hk}x{d}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("k, v and the pool need a contiguous last dimension")

"""Shape facts derived from a Hugging Face config, computed in one place.

Accepts a config object (transformers' PretrainedConfig, any attribute holder) or a plain dict (a parsed
config.json), so the model code, the KV pool and the transfer benchmarks agree on every shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def head_dim(cfg: Any) -> int:
    """Per-head width of queries and keys: `head_dim` when the config sets it (Qwen3, Gemma 3 set it apart from
    hidden / heads), else hidden_size // num_attention_heads (Llama)."""
    explicit = _get(cfg, "head_dim")
    if explicit:
        return int(explicit)
    return int(_get(cfg, "hidden_size")) // int(_get(cfg, "num_attention_heads"))


def num_experts(cfg: Any) -> int:
    """Routed experts per MoE layer (0 for a dense model); configs spell it num_experts (Qwen MoE),
    num_local_experts (Mixtral; what transformers 5 writes for Qwen3-MoE too) or n_routed_experts (DeepSeek)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = _get(cfg, key)
        if value:
            return int(value)
    return 0

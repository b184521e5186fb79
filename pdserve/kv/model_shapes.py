"""KV geometry of known models (or of any HF config.json), for sizing transfer benchmarks without loading weights.

A block of the block-major pool holds `num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes` bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pdserve.model import shapes


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def block_bytes(self, block_size: int) -> int:
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes


# From the models' published config.json files.
KNOWN = {
    "qwen3-8b": KVShape("qwen3-8b", 36, 8, 128),
    "qwen3-0.6b": KVShape("qwen3-0.6b", 28, 8, 128),
    "qwen3-32b": KVShape("qwen3-32b", 64, 8, 128),
    "llama-3.1-8b": KVShape("llama-3.1-8b", 32, 8, 128),
    "llama-3.1-70b": KVShape("llama-3.1-70b", 80, 8, 128),
    "gemma-3-270m": KVShape("gemma-3-270m", 18, 1, 256),
    "qwen3-30b-a3b": KVShape("qwen3-30b-a3b", 48, 4, 128),
}


def kv_shape(name_or_path: str, dtype_bytes: int = 2) -> KVShape:
    """A known model name, or a path to a HF config.json (or a directory holding one)."""
    key = name_or_path.lower()
    if key in KNOWN:
        s = KNOWN[key]
        return KVShape(s.name, s.num_layers, s.num_kv_heads, s.head_dim, dtype_bytes)
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"unknown model config {name_or_path!r}: use one of {sorted(KNOWN)} or a config.json path")
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = shapes.head_dim(cfg)
    return KVShape(os.path.basename(os.path.dirname(os.path.abspath(path))), layers, kv_heads, head_dim, dtype_bytes)

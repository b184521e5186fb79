"""Llama (Llama 2/3 family): pre-norm decoder, GQA, SwiGLU, RoPE with optional llama3 scaling."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model.layers import GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding
from pdserve.model.rope_config import rope_params


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rope: RotaryEmbedding, qk_norm: bool = False):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        sliding = None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types and layer_types[layer_idx] == "sliding_attention" and getattr(cfg, "sliding_window", None):
            sliding = cfg.sliding_window
        self.self_attn = PagedAttention(
            layer_idx,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            rope,
            scale=head_dim**-0.5,
            bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm_eps=cfg.rms_norm_eps if qk_norm else None,
            sliding_window=sliding,
        )
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    qk_norm = False

    def __init__(self, cfg):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        base, scaling = rope_params(cfg)
        rope = RotaryEmbedding(head_dim, base, cfg.max_position_embeddings, scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(cfg, i, rope, qk_norm=self.qk_norm) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    inner_cls = LlamaModel

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = self.inner_cls(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

"""Gemma 3 (text): interleaved sliding-window and global layers with their own RoPE bases, (1 + w) RMS norms
around attention and MLP, QK-norm, sqrt(hidden) embedding scaling, tied embeddings, GELU-tanh MLP. The residual
stream is carried separately, as in Llama."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model.layers import GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding
from pdserve.model.parallel import ParallelLMHead, VocabParallelEmbedding
from pdserve.model.rope_config import rope_params


def layer_types(cfg) -> list[str]:
    lt = getattr(cfg, "layer_types", None)
    if lt:
        return list(lt)
    pattern = getattr(cfg, "sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.num_hidden_layers)]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rope: RotaryEmbedding, sliding: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = PagedAttention(
            layer_idx,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            rope,
            scale=cfg.query_pre_attn_scalar**-0.5,
            bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm_eps=eps,
            qk_norm_offset=1.0,
            sliding_window=cfg.sliding_window if sliding else None,
            softcap=getattr(cfg, "attn_logit_softcapping", None),
        )
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), as in Llama; the sandwich norms stay inside."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        types = layer_types(cfg)
        ropes = {}
        for t in set(types):
            base, scaling = rope_params(cfg, t)
            ropes[t] = RotaryEmbedding(cfg.head_dim, base, cfg.max_position_embeddings, scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma3DecoderLayer(cfg, i, ropes[t], t == "sliding_attention") for i, t in enumerate(types)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0)
        self.hidden_size = cfg.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the tokens at `rows` (all tokens when None)."""
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)  # the normalizer in the dtype
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm.final(hidden, residual, rows)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = Gemma3TextModel(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        self.lm_head.weight = self.model.embed_tokens.weight  # Gemma always ties
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the full vocabulary (on rank 0 of a tensor-parallel group; None on the other ranks)."""
        logits = self.lm_head(hidden)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

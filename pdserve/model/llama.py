"""Llama (Llama 2/3 family): pre-norm decoder, GQA, SwiGLU, RoPE with optional llama3 scaling.

Decoder layers carry the residual stream separately (`hidden, residual = layer(positions, hidden, residual)`),
so each residual add is fused into the norm after it; o_proj and down_proj may hand that norm float32 partial sums
over K instead of their output (pdserve.ops.split_k: a few hundred rows, on a GPU whose measured table says so).
Tensor-parallel through the shared layers (pdserve.model.parallel): vocabulary-parallel embedding and LM head,
sharded attention and MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model import shapes
from pdserve.model.layers import GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding
from pdserve.model.parallel import ParallelLMHead, VocabParallelEmbedding
from pdserve.model.rope_config import rope_params
from pdserve.ops.norm_fold import NormedRow
from pdserve.ops.split_k import PartialSums


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rope: RotaryEmbedding, qk_norm: bool = False):
        super().__init__()
        head_dim = shapes.head_dim(cfg)
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

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | NormedRow, residual: torch.Tensor | None = None,
                next_norm: RMSNorm | None = None) -> tuple[torch.Tensor | PartialSums | NormedRow, torch.Tensor]:
        """(this layer's output, the residual stream before it): the next norm adds them. For one row on CUDA the
        norms may be folded into the products around them (pdserve.ops.norm_fold): `hidden` may come in as this
        layer's input norm already left to q/k/v, and with `next_norm` (the next layer's input norm) the output may
        go out as that norm (a NormedRow, with the residual stream it holds)."""
        if isinstance(hidden, NormedRow):
            residual = hidden.h
        elif residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        # MoE models put their sparse block in place of the dense MLP (qwen3_moe.py): it takes and returns tensors
        dense = isinstance(self.mlp, GatedMLP)
        hidden = self.self_attn(positions, hidden, parts=True,
                                norm_after=(residual, self.post_attention_layernorm) if dense else None)
        if isinstance(hidden, NormedRow):
            residual = hidden.h
        else:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
        if not dense:
            return self.mlp(hidden), residual
        out = self.mlp(hidden, parts=True, norm_after=(residual, next_norm) if next_norm is not None else None)
        return out, (out.h if isinstance(out, NormedRow) else residual)


class LlamaModel(nn.Module):
    qk_norm = False

    def __init__(self, cfg):
        super().__init__()
        head_dim = shapes.head_dim(cfg)
        base, scaling = rope_params(cfg)
        rope = RotaryEmbedding(head_dim, base, cfg.max_position_embeddings, scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(cfg, i, rope, qk_norm=self.qk_norm) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the tokens at `rows` (all tokens when None)."""
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual,
                                     self.layers[i + 1].input_layernorm if i < last else None)
        return self.norm.final(hidden, residual, rows)


class LlamaForCausalLM(nn.Module):
    inner_cls = LlamaModel

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = self.inner_cls(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the full vocabulary (on rank 0 of a tensor-parallel group; None on the other ranks)."""
        return self.lm_head(hidden)

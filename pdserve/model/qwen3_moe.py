"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (QK-norm, GQA, RoPE) with a sparse MoE block in
place of the dense MLP on layers where `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`.

The sparse block: router linear `gate` -> softmax over the experts in float32 -> top-k -> renormalised when
`norm_topk_prob` -> the experts' SiLU-gated MLPs weighted by the routing weights and summed (pdserve.model.moe).
Only the MLP differs from the dense model, so the decoder layers are Qwen3's own and every speed-up of the dense
layers (fused norms, rotary, attention) applies here too.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from pdserve.model.layers import GatedMLP
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.moe import FusedMoE, is_sparse_layer, moe_checkpoint_target, router_logits
from pdserve.model.qwen3 import Qwen3Model
from pdserve.model.shapes import num_experts
from pdserve.ops.split_k import PartialSums
from pdserve.parallel.group import current_tp

__all__ = ["Qwen3MoeForCausalLM", "Qwen3MoeModel", "Qwen3MoeSparseBlock", "is_sparse_layer"]


class Qwen3MoeSparseBlock(nn.Module):
    """`gate` (router) and `experts`, under the checkpoint's names (`mlp.gate.weight`, `mlp.experts.<e>.*`)."""

    def __init__(self, cfg):
        super().__init__()
        n_exp = num_experts(cfg)
        self.gate = nn.Linear(cfg.hidden_size, n_exp, bias=False)
        self.experts = FusedMoE(n_exp, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                                activation=getattr(cfg, "hidden_act", "silu"))
        self.tp_size = current_tp().size

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSums:
        """The block's output, which the decoder layer hands to the next add+RMSNorm: on one rank it may stay the
        experts' rows for that norm to sum (FusedMoE.forward's `parts`)."""
        return self.experts(x, router_logits(self.gate, x), parts=self.tp_size == 1)


class Qwen3MoeModel(Qwen3Model):
    def __init__(self, cfg):
        # The dense parent builds every layer with a width-1 MLP (a few kilobytes instead of a 6144-wide MLP per
        # layer), which is then replaced: the sparse block, or the dense MLP of mlp_only_layers at full width.
        placeholder = copy.copy(cfg)
        placeholder.intermediate_size = 1
        super().__init__(placeholder)
        act = getattr(cfg, "hidden_act", "silu")
        for i, layer in enumerate(self.layers):
            if is_sparse_layer(cfg, i):
                layer.mlp = Qwen3MoeSparseBlock(cfg)
            else:
                layer.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    inner_cls = Qwen3MoeModel

    def checkpoint_target(self, name: str):
        """Experts' tensors fill parts of the stacked w13/w2 (see pdserve.model.moe)."""
        return moe_checkpoint_target(self, name)

"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Llama decoder with biased q/k/v projections (`qkv_bias`), and
on sparse layers Qwen3-MoE's routed experts plus a dense shared expert scaled by sigmoid(shared_expert_gate(x)).
A second MoE family on pdserve.model.moe: only the shared expert is new."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pdserve.model.layers import GatedMLP
from pdserve.model.llama import LlamaForCausalLM, LlamaModel
from pdserve.model.moe import FusedMoE, is_sparse_layer, moe_checkpoint_target, router_logits
from pdserve.model.shapes import num_experts


class Qwen2MoeSparseBlock(nn.Module):
    """`gate`, `experts`, `shared_expert`, `shared_expert_gate`, under the checkpoint's names."""

    def __init__(self, cfg):
        super().__init__()
        n_exp = num_experts(cfg)
        act = getattr(cfg, "hidden_act", "silu")
        self.gate = nn.Linear(cfg.hidden_size, n_exp, bias=False)
        self.experts = FusedMoE(n_exp, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                renormalize=bool(getattr(cfg, "norm_topk_prob", False)), activation=act)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, act)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, router_logits(self.gate, x)) + shared


class Qwen2MoeModel(LlamaModel):
    def __init__(self, cfg):
        # width-1 placeholder MLPs in the parent, replaced below (see qwen3_moe.py); Qwen2 names its q/k/v bias
        # qkv_bias where the Llama layer reads attention_bias
        placeholder = copy.copy(cfg)
        placeholder.intermediate_size = 1
        placeholder.attention_bias = bool(getattr(cfg, "qkv_bias", True))
        super().__init__(placeholder)
        act = getattr(cfg, "hidden_act", "silu")
        for i, layer in enumerate(self.layers):
            layer.mlp = Qwen2MoeSparseBlock(cfg) if is_sparse_layer(cfg, i) else GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, act)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    inner_cls = Qwen2MoeModel

    def checkpoint_target(self, name: str):
        return moe_checkpoint_target(self, name)

"""The mixture-of-experts layer the MoE families share: routing, stacked expert weights, the fused experts.

`FusedMoE` holds every expert's weights stacked, `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`, and
turns router logits into the experts' weighted sum: a routing function picks top-k experts and their weights (on
the Triton path its one-launch kernel, `pdserve.ops.moe_route`; the torch function is its oracle), then
`pdserve.ops.fused_moe` runs the experts (the Triton kernels on CUDA, the torch reference elsewhere).

A family is a few lines on top: Qwen3-MoE is a router linear `gate` plus FusedMoE (qwen3_moe.py); Mixtral is the
same with `ExpertNames("w1", "w3", "w2")` under `block_sparse_moe`; Qwen2-MoE adds a dense shared expert scaled by
sigmoid(shared_expert_gate(x)) to FusedMoE's output.

Checkpoints store experts one by one (`experts.<e>.gate_proj.weight` [I, H], ...) or, as transformers 5 keeps them
in memory, stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); `checkpoint_target` tells the
loader which part of w13/w2 each tensor fills, so loading stacks in place with one tensor in memory at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import pdserve.ops.linear as linear_ops
from pdserve.model.loader import WeightTarget
from pdserve.model.shapes import num_experts
from pdserve.ops.fused_moe import ACTIVATIONS, fused_moe_ref
from pdserve.ops.split_k import PartialSums


def is_sparse_layer(cfg, layer_idx: int) -> bool:
    """transformers' rule for the Qwen MoE families: layer i is sparse unless listed in `mlp_only_layers`, when
    the model has experts and (i + 1) is a multiple of `decoder_sparse_step`."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and num_experts(cfg) > 0 and (layer_idx + 1) % step == 0)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top k, optionally renormalised to sum to 1 (Qwen3-MoE with
    norm_topk_prob, Mixtral). Returns (weights float32 [T, k], expert ids int32 [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


Routing = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
ROUTING: dict[str, Routing] = {
    "softmax": softmax_topk,
}


def _route_topk() -> Routing:
    from pdserve.ops.moe_route import route_topk

    return route_topk


# the routing functions' one-launch Triton kernels (imported when first used), where the experts run on Triton
TRITON_ROUTING: dict[str, Callable[[], Routing]] = {"softmax": _route_topk}


# SUM_IN_NORM: a MoE layer whose caller allows it (Qwen3-MoE's sparse block on one rank) leaves the sum over each
# token's top-k experts to the next add+RMSNorm (pdserve.ops.norm adds up to NORM_MAX_PARTS parts) instead of a
# reduce kernel of its own: at one row that kernel took 222 us of a dummy Qwen3-30B-A3B step's marginal time, at 256
# rows 337 (48 launches, benchmarks/lease_s35/s35d). Measured on an H200 (fp8 pool, async loops at temperature 1, one
# process an arm, in the order off, on, off, on; benchmarks/lease_s37/s37c): 1 row at 1k 3.36/3.36 ms a step against
# 3.58/3.58 without, 256 rows at 1k 21.67/21.67 against 21.88/21.89. bench_steps.py --no-moe-sum-in-norm: the A/B.
SUM_IN_NORM = True

# ROUTER_SKINNY: a sparse block's router product (`gate`, [E, H]) through pdserve.ops.linear.linear, which sends a
# few rows of a 16-bit CUDA tensor to the skinny kernel (launched with PDL: its first weight tile loads while the norm
# before it finishes) where the card's table or the one-row default says so, in place of nn.Linear's cuBLAS call. At
# one row that call (nvjet, [128, 2048]) took 251 us of a dummy Qwen3-30B-A3B step's marginal time over 48 layers
# (benchmarks/lease_s35/s35d). Measured in benchmarks/lease_s38/s38b (arms off, on, off, on, one process each): the
# batch-1 loop at 1k context 3.24 -> 3.12 ms a step and at 8k 3.52 -> 3.41 ms, the 4-row step 5.12 -> 4.79 ms. On.
ROUTER_SKINNY = True


def router_logits(gate: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A sparse block's router logits `gate(x)` [T, E] (ROUTER_SKINNY says by which kernel)."""
    if ROUTER_SKINNY and gate.bias is None:
        return linear_ops.linear(x, gate.weight)
    return gate(x)


def _backend(backend: str, x: torch.Tensor) -> str:
    return ("triton" if x.is_cuda else "torch") if backend == "auto" else backend


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", backend: str = "auto",
                  parts: bool = False) -> torch.Tensor | PartialSums:
    """Run the experts: backend "triton" (fused kernels), "torch" (the reference) or "auto" (Triton on CUDA).
    `parts`: the Triton path may leave the sum over each token's experts to the add+RMSNorm after the layer
    (pdserve.ops.fused_moe); the reference always sums."""
    backend = _backend(backend, x)
    if backend == "triton":
        from pdserve.ops.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids, activation, parts=parts)
    if backend == "torch":
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation)
    raise ValueError(f"unknown MoE backend {backend!r}: auto, triton or torch")


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint names of one expert's projections (`experts.<e>.<name>.weight`)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, activation: str = "silu", routing: str = "softmax",
                 names: ExpertNames = ExpertNames(), backend: str = "auto"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        if routing not in ROUTING:
            raise ValueError(f"unsupported MoE routing {routing!r}; supported: {', '.join(ROUTING)}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize, self.activation, self.routing, self.backend = renormalize, activation, routing, backend
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        n = re.escape
        self._per_expert = re.compile(rf"^(\d+)\.({n(names.gate)}|{n(names.up)}|{n(names.down)})\.weight$")
        self._names = names

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, parts: bool = False) -> torch.Tensor | PartialSums:
        """The experts' output for each token; `parts` (a caller whose next step is an add+RMSNorm): with
        SUM_IN_NORM, on the Triton path, the rows of each token's experts, which that norm sums."""
        if self.routing in TRITON_ROUTING and _backend(self.backend, x) == "triton":
            weights, ids = TRITON_ROUTING[self.routing]()(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = ROUTING[self.routing](router_logits, self.top_k, self.renormalize)
        return fused_experts(x, self.w13, self.w2, weights, ids, self.activation, self.backend,
                             parts=parts and SUM_IN_NORM)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        """Map a checkpoint name relative to this module (`5.gate_proj.weight`, `gate_up_proj`) to a part of w13/w2;
        None for a name that is not an expert weight."""
        m = self._per_expert.match(name)
        if m:
            e, proj = int(m.group(1)), m.group(2)
            if e >= self.num_experts:
                return None
            inter = self.intermediate_size
            if proj == self._names.gate:
                return WeightTarget("w13", (e, slice(0, inter)))
            if proj == self._names.up:
                return WeightTarget("w13", (e, slice(inter, 2 * inter)))
            return WeightTarget("w2", (e,))
        if name == "gate_up_proj":
            return WeightTarget("w13")
        if name == "down_proj":
            return WeightTarget("w2")
        return None

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}, act={self.activation}")


def moe_checkpoint_target(model: nn.Module, name: str) -> WeightTarget | None:
    """The loader hook for any model with FusedMoE modules: route names under a FusedMoE to its checkpoint_target,
    prefixed with the module's path; None (load by name) for everything else."""
    index = getattr(model, "_fused_moe_index", None)
    if index is None:
        index = {path: m for path, m in model.named_modules() if isinstance(m, FusedMoE)}
        model._fused_moe_index = index
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = index.get(".".join(parts[:i]))
        if module is not None:
            target = module.checkpoint_target(".".join(parts[i:]))
            if target is None:
                return None
            return WeightTarget(".".join(parts[:i]) + "." + target.param, target.index)
    return None

"""Building blocks shared by the architectures: norms, rotary embeddings, gated MLPs and paged attention.

On CUDA they call the fused Triton kernels of pdserve.ops (norm with the residual add, QK-norm + rotary, gated
activation); on CPU the torch references, which are the math of the Hugging Face models. QKV and gate_up are single
GEMMs over merged weights whose rows are the checkpoint's q/k/v and gate/up matrices (pdserve.model.merged).

Under tensor parallelism (pdserve.model.parallel) each rank builds the same modules over its shard: its query and KV
heads, its run of the intermediate size; o_proj and down_proj all-reduce. Parameter names stay Hugging Face's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.model.forward_context import attend, kv_target, rope_in_attention
from pdserve.model.merged import MergedLinearOwner, merge_linears, merged_parts
from pdserve.model.parallel import RowParallelLinear, column_linear
from pdserve.ops.activation import ACTIVATIONS, act_and_mul
from pdserve.ops.attention.common import QKRope
from pdserve.ops.linear import SKINNY_MAX_ROWS, linear
from pdserve.ops.norm import final_rms_norm, fused_add_rms_norm, rms_norm
from pdserve.ops.norm_fold import NormedRow
from pdserve.ops.rotary import qk_norm_rope
from pdserve.ops.split_k import PartialSums
from pdserve.parallel.group import current_tp
from pdserve.parallel.ranges import even_range, kv_head_range

# Rows of one MLP pass: a longer step goes through in parts of this many tokens, so the MLP's [tokens, 3 x
# intermediate / tp] temporaries (a prefill step's largest: 576 MiB at 8192 tokens of Qwen3-8B, which the KV pool
# must leave free) stay this size. Steps of up to 4096 tokens (every CUDA-graph step among them) are one pass.
MLP_CHUNK_TOKENS = 4096


def mlp_parts(n: int) -> list[tuple[int, int]]:
    """[start, end) of each MLP pass over a step of n tokens: MLP_CHUNK_TOKENS each, a last part of at most
    SKINNY_MAX_ROWS rows joining the one before it. A part of a few rows would take the few-row product kernels,
    and a part of one row the one-row gate_up kernel that no other step runs (one-row decode steps fold the norm
    into it) and the warm-up never compiles: one server of four in benchmarks/lease_s27/interfere compiled that
    kernel while serving, and a step of 4096 + 1 tokens is the one path found that runs it."""
    starts = list(range(0, n, MLP_CHUNK_TOKENS))
    if len(starts) > 1 and n - starts[-1] <= SKINNY_MAX_ROWS:
        starts.pop()
    return list(zip(starts, starts[1:] + [n]))


class RMSNorm(nn.Module):
    """RMS norm; `offset=1` is Gemma's (1 + weight) form. Given a residual, adds it first and returns
    (normed, new residual) — the pre-norm decoder's residual stream in one kernel."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)

    def final(self, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x + residual) of `rows` only (every row when None): the model's last norm."""
        return final_rms_norm(x, residual, self.weight, self.eps, self.offset, rows)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), with linear and llama3 frequency scaling; float32 cos/sin
    caches `[max_positions, head_dim / 2]` that the fused kernel indexes by position."""

    def __init__(self, head_dim: int, base: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_rope(q, k, positions, self.cos, self.sin)


class GatedMLP(MergedLinearOwner):
    """down(act(gate(x)) * up(x)) with gate and up as one GEMM and the activation fused with the product.
    Tensor-parallel: gate/up column-parallel and down row-parallel over the intermediate size."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        tp = current_tp()
        lo, hi = even_range(intermediate, tp, "the MLP's intermediate size")
        with merged_parts():
            self.gate_proj = column_linear(hidden, intermediate, False, lo, hi, tp)
            self.up_proj = column_linear(hidden, intermediate, False, lo, hi, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, lo, hi, tp)
        self.act = ACTIVATIONS[act]
        merge_linears(self, "gate_up", [self.gate_proj, self.up_proj])

    def _merged(self):
        return [("gate_up", [self.gate_proj, self.up_proj])]

    def forward(self, x: torch.Tensor | NormedRow, parts: bool = False,
                norm_after: tuple[torch.Tensor, RMSNorm] | None = None) -> torch.Tensor | PartialSums | NormedRow:
        """down(act(gate(x)) * up(x)); with `parts`, the down projection may come back as float32 partial sums over
        K (pdserve.ops.split_k) for the caller's add+RMSNorm to sum. `x` may be a norm left to this product
        (pdserve.ops.norm_fold); with `norm_after` (residual, the next norm), one row may come back as that norm
        of (output + residual), left to the next product."""
        if isinstance(x, NormedRow):
            gate_up = x.linear(self.gate_up_weight)
            if norm_after is not None:
                folded = self.down_proj.forward_norm(gate_up, norm_after[0], norm_after[1], self.act)
                if folded is not None:
                    return folded
            return self.down_proj.act_forward(gate_up, self.act)
        n = x.shape[0]
        if norm_after is not None and n == 1:
            gate_up = linear(x, self.gate_up_weight)
            folded = self.down_proj.forward_norm(gate_up, norm_after[0], norm_after[1], self.act)
            return folded if folded is not None else self.down_proj.act_forward(gate_up, self.act)
        if parts and 1 < n <= MLP_CHUNK_TOKENS:
            return self.down_proj.forward_parts(self._act(x))
        if n <= MLP_CHUNK_TOKENS:  # for one row on CUDA the activation runs inside the down projection's kernel
            return self.down_proj.act_forward(linear(x, self.gate_up_weight), self.act)
        out = x.new_empty((n, self.down_proj.out_features))  # each part's down projection lands in place (no cat)
        for s, e in mlp_parts(n):
            self.down_proj.partial_into(self._act(x[s:e]), out[s:e])
        return self.down_proj.finish(out)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(linear(x, self.gate_up_weight), self.act)


class PagedAttention(MergedLinearOwner):
    """Self-attention whose K/V live in the engine's paged pool; QK-norm optional (Qwen3, Gemma 3).

    `k_scale`/`v_scale` (0-d float32, 1.0 unless the checkpoint has `*.self_attn.k_scale`/`v_scale`) are the
    per-layer scales of an fp8 KV cache: stored K = k / k_scale.

    Tensor-parallel: `num_heads`/`num_kv_heads` are the model's; this rank keeps its query heads and the KV heads
    they use (`kv_head_range`), and `self.num_heads`/`self.num_kv_heads` are its local counts."""

    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RotaryEmbedding,
        scale: float,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        tp = current_tp()
        q0, q1 = even_range(num_heads, tp, "the number of attention heads")
        k0, k1 = kv_head_range(num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        d = head_dim
        with merged_parts():
            self.q_proj = column_linear(hidden, num_heads * d, bias, q0 * d, q1 * d, tp)
            self.k_proj = column_linear(hidden, num_kv_heads * d, bias, k0 * d, k1 * d, tp)
            self.v_proj = column_linear(hidden, num_kv_heads * d, bias, k0 * d, k1 * d, tp)
        self.o_proj = RowParallelLinear(num_heads * d, hidden, False, q0 * d, q1 * d, tp)
        merge_linears(self, "qkv", [self.q_proj, self.k_proj, self.v_proj])
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, qk_norm_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, qk_norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.register_buffer("k_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.rope = rope
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    def _merged(self):
        return [("qkv", [self.q_proj, self.k_proj, self.v_proj])]

    def forward(self, positions: torch.Tensor, x: torch.Tensor | NormedRow, parts: bool = False,
                norm_after: tuple[torch.Tensor, RMSNorm] | None = None) -> torch.Tensor | PartialSums | NormedRow:
        """The layer's attention output after o_proj; with `parts`, possibly as float32 partial sums over K
        (pdserve.ops.split_k) for the caller's add+RMSNorm to sum. `x` may be a norm left to the q/k/v product
        (pdserve.ops.norm_fold); with `norm_after` (residual, the next norm), one row may come back as that norm of
        (output + residual), left to the next product."""
        t = x.shape[0]
        qkv = x.linear(self.qkv_weight, self.qkv_bias) if isinstance(x, NormedRow) else linear(
            x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        kv = kv_target(self)  # the rotary kernel writes the new K/V into the pool where the backend allows it
        if self.q_norm is not None:
            rope = QKRope(positions, self.rope.cos, self.rope.sin, self.q_norm.weight, self.k_norm.weight,
                          self.q_norm.eps, self.q_norm.offset)
        else:
            rope = QKRope(positions, self.rope.cos, self.rope.sin)
        if rope_in_attention(q, kv, rope):  # the decode kernel norms, rotates and writes them (decode.ROPE_IN_DECODE)
            o = attend(self, q, k, v, kv=kv, rope=rope).reshape(t, self.q_size)
        else:
            q, k = qk_norm_rope(q, k, positions, rope.cos, rope.sin, rope.q_weight, rope.k_weight, rope.eps,
                                rope.offset, v=v, kv=kv)
            o = attend(self, q, k, v, kv=kv).reshape(t, self.q_size)
        if norm_after is not None:
            folded = self.o_proj.forward_norm(o, norm_after[0], norm_after[1])
            if folded is not None:
                return folded
        return self.o_proj.forward_parts(o) if parts else self.o_proj(o)

"""Tensor-parallel layers and how each rank's shard maps to the checkpoint (Megatron's split, as vLLM does it).

- Column-parallel linear (`column_linear`): the rank keeps a run of output rows; no communication. QKV and gate_up
  are column-parallel pieces merged per rank (pdserve.model.merged), so each rank still runs one GEMM.
- Row-parallel linear (`RowParallelLinear`): the rank keeps a run of input columns, multiplies its slice of the
  activations and all-reduces the partial sums (o_proj, down_proj). A bias is added once, after the sum.
- Attention: query heads split evenly; KV heads split evenly, or — with more ranks than KV heads — each rank holds
  the one KV head its query heads use (replicated: Gemma 3 270M has one KV head for every rank).
- Vocabulary-parallel embedding: each rank holds a run of rows (the vocabulary padded to a multiple of the ranks),
  looks up the ids it holds, zeroes the rest, and the ranks' rows are summed. The LM head holds the same rows
  (tied weights stay tied); its logits shards are gathered to rank 0, which samples.

Every sharded parameter carries a `ShardSpec` (`param.shard`): which run of the checkpoint tensor it holds along
which dimension. The loader reads only that run (`load_param`, through safetensors' lazy slices) and dummy weights
take the same run of the full tensor (`take_shard`), so any TP size builds the same model. An MoE layer shards its
experts the same way: w13 column-parallel over the intermediate size, w2 row-parallel plus one all-reduce.

At size 1 every layer is the plain one: full shapes, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.ops.activation import act_and_mul
from pdserve.ops.linear import act_folds, act_linear, linear
from pdserve.ops.norm_fold import can_produce, produce
from pdserve.ops.split_k import PartialSums, linear_parts
from pdserve.parallel.group import TPGroup, current_tp


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds rows [start, stop) along `dim` of a checkpoint tensor `full` long on that dimension. The
    parameter may be longer than stop - start (padding rows, zero)."""

    dim: int
    start: int
    stop: int
    full: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def set_shard(param: nn.Parameter | None, spec: ShardSpec) -> None:
    if param is not None:
        param.shard = spec


def shard_of(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "shard", None)


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, stop, rows): the vocabulary rows this rank holds and its padded row count (equal on every rank)."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def column_linear(in_features: int, out_features: int, bias: bool, start: int, stop: int,
                  tp: TPGroup) -> nn.Linear:
    """A linear holding output rows [start, stop) of an `out_features` x `in_features` checkpoint matrix."""
    lin = nn.Linear(in_features, stop - start, bias=bias)
    if tp.size > 1:
        spec = ShardSpec(0, start, stop, out_features)
        set_shard(lin.weight, spec)
        set_shard(lin.bias, spec)
    return lin


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_rank @ W[:, cols_rank]^T (+ bias once): holds input columns [start, stop)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, start: int, stop: int, tp: TPGroup):
        super().__init__(stop - start, out_features, bias=bias)
        self.tp = tp
        if tp.size > 1:
            set_shard(self.weight, ShardSpec(1, start, stop, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor | PartialSums:
        """forward(x), or its float32 partial sums over K where the measured table splits this product at x's row
        count (pdserve.ops.split_k): for a caller whose next op is an add+RMSNorm, which sums them. One rank, no
        bias only (the ranks' outputs are all-reduced as one tensor)."""
        if self.tp.size == 1 and self.bias is None:
            return linear_parts(x, self.weight)
        return self.forward(x)

    def act_forward(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """forward(act(gate) * up) of a merged gate_up [T, 2 * in_features]: for one row on CUDA the activation
        runs inside the product's kernel (pdserve.ops.linear.act_linear)."""
        if self.tp.size == 1:
            return act_linear(gate_up, act, self.weight, self.bias)
        y = self.tp.all_reduce(act_linear(gate_up, act, self.weight))
        return y + self.bias if self.bias is not None else y

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor, norm, act: str | None = None):
        """norm(forward(x) + residual) left for the next one-row product (pdserve.ops.norm_fold.NormedRow), or
        None where the fold does not serve (more rows, CPU, several ranks, a bias, a shape the sum kernel does not
        run): the caller then runs the product and the norm as before. With `act`, x is a merged gate_up row and
        the input is act(gate) * up."""
        if self.tp.size != 1 or self.bias is not None or x.dim() != 2 or x.shape[0] != 1:
            return None
        if act is not None and not act_folds():
            x, act = act_and_mul(x, act), None
        if not can_produce(x, self.weight, gated=act is not None):
            return None
        return produce(x, self.weight, residual, norm.weight, norm.eps, norm.offset, act)

    def partial_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's x @ W^T written into `out` (rows of a larger output); `finish` then sums the ranks once."""
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            out.copy_(F.linear(x, self.weight))  # autograd does not record mm(out=...)
        else:
            torch.mm(x, self.weight.t(), out=out)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of outputs written by `partial_into`, plus the bias once."""
        if self.tp.size > 1:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows; the ranks' lookups are summed (each id lives on one)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp = current_tp()
        self.vocab_size = vocab_size
        self.start, self.stop, rows = vocab_range(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden))  # written by the loader or the dummy init, never
        # read before: a random init here cost 2.7 s of every CPU start (Gemma 3's 262k x 640 table)
        if self.tp.size > 1:
            set_shard(self.weight, ShardSpec(0, self.start, self.stop, vocab_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        out = F.embedding((ids - self.start) * mine, self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over this rank's vocabulary rows, gathered to rank 0 (the full vocabulary there, None elsewhere)."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__()
        self.tp = current_tp()
        self.vocab_size = vocab_size
        start, stop, rows = vocab_range(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden))  # written by the loader or the dummy init (or tied)
        if self.tp.size > 1:
            set_shard(self.weight, ShardSpec(0, start, stop, vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        full = self.tp.gather_to_first(logits)
        return full[..., : self.vocab_size] if full is not None else None


# ---- loading


def _target(param: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The part of `param` that checkpoint values fill (all of it, or the rows before the padding)."""
    if spec is None or param.shape[spec.dim] == spec.length:
        return param
    param.narrow(spec.dim, spec.length, param.shape[spec.dim] - spec.length).zero_()
    return param.narrow(spec.dim, 0, spec.length)


def load_param(param: torch.Tensor, lazy, name: str) -> None:
    """The loader's hook: copy this rank's run of checkpoint tensor `name` into `param`. `lazy` is a safetensors
    slice (`get_shape()`, indexing reads only the indexed bytes)."""
    spec = shard_of(param)
    full_shape = list(lazy.get_shape())
    expect = list(param.shape)
    if spec is not None:
        expect[spec.dim] = spec.full
    if full_shape != expect:
        raise ValueError(f"weight {name} has shape {tuple(full_shape)}, the model expects {tuple(expect)}")
    tensor = lazy[spec.index()] if spec is not None else lazy[()]
    with torch.no_grad():
        _target(param, spec).copy_(tensor.to(param.dtype))


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The checkpoint tensor's shape of which `param` holds a shard."""
    spec = shard_of(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full
    return tuple(shape)


def take_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Fill `param` with its run of the full tensor `full` (dummy weights: the same model at any TP size)."""
    spec = shard_of(param)
    with torch.no_grad():
        _target(param, spec).copy_(full[spec.index()] if spec is not None else full)

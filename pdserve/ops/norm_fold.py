"""The add+RMSNorm between two one-row products folded into them: no norm kernel between o_proj and gate_up, or
between down_proj and the next layer's q/k/v, in a batch-1 decode step.

An RMS norm needs its whole row before any element is known (1 / rms is a sum over every column), so it cannot
live in the programs of the product that consumes it, each of which reads the whole row: session 19 tried that and
every program of gate_up's one-row tile (6,144 of them) re-read the row, its residual and the norm's weight from
L2, which cost more than the kernel it saved (benchmarks/lease_s19/s19b, s19c). Here the work is split by what each
side already has:

- the product before the norm (`produce`: o_proj, or down_proj with the activation folded in) owns a few output
  columns per program. Its epilogue adds the residual to them (the residual stream `h`, rounded as the add+RMSNorm
  kernel rounds), stores `h`, stores `h * w` (w: the norm's weight, plus Gemma's offset), and stores the program's
  sum of h^2 as one float32 partial;
- the product after it (`NormedRow.linear`: q/k/v or gate_up) reads `h * w` where it read the normed row, sums the
  few hundred partials once per program at the end (2 KiB from L2), and scales its float32 sums by
  rsqrt(mean(h^2) + eps). As W (h * w) * r = W (h * r * w) in exact arithmetic, this is the norm then the product;
  it rounds differently (h * w to the model's dtype once, where the kernel rounds h * r * w once), by the same few
  units in the last place as any two kernels.

Measured on an H200 (benchmarks/lease_s24/s24a, dummy Qwen3-8B, the async batch-1 loops, on/off alternating twice):
4.56-4.57 against 4.60 ms a step at 8k of context, 4.26 against 4.29 at 1k. That is 71 kernels a step fewer for
0.03-0.04 ms: under programmatic dependent launch a norm kernel between two products cost less than the ablation of
session 19 suggested (0.15 ms for all 73), and the products' extra loads take some of it back.

One row on CUDA (the skinny sum kernel on both sides, one tensor-parallel rank, no bias on the producer); everything
else takes the norm's own kernel: `NormedRow.materialize()` is that kernel on `h`. The partial sums are kept in a
fixed order (no atomics), so a step gives the same bits every time it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.ops.dispatch import HAS_TRITON
from pdserve.ops.linear import SkinnyConfig, fold_config, skinny_config, use_skinny
from pdserve.ops.pdl import pdl_args

if HAS_TRITON:
    import triton

    from pdserve.ops.linear import _skinny_sum_kernel

_enabled = True


def set_norm_fold(enabled: bool) -> bool:
    """Fold the add+RMSNorm into the one-row products around it (default) or run its kernel (an A/B in one
    process, bench_steps.py --no-fold-norm); returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, enabled
    return prev


def norm_fold_enabled() -> bool:
    return _enabled


@dataclass(frozen=True)
class NormedRow:
    """norm(h) of one row, not yet computed: `h` [1, K] the residual stream (the norm's input), `hw` = h * (weight +
    offset) in h's dtype, `partials` [P] float32 whose sum is sum(h^2)."""

    h: torch.Tensor
    hw: torch.Tensor
    partials: torch.Tensor
    weight: torch.Tensor
    eps: float
    offset: float

    @property
    def shape(self) -> torch.Size:
        return self.h.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.h.dtype

    @property
    def device(self) -> torch.device:
        return self.h.device

    def materialize(self) -> torch.Tensor:
        """norm(h) by the norm's own kernel (or reference): for a consumer that cannot take the fold."""
        from pdserve.ops.norm import rms_norm
        return rms_norm(self.h, self.weight, self.eps, self.offset)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None, config: SkinnyConfig | None = None
               ) -> torch.Tensor:
        """norm(h) @ weight^T (+ bias): in the one-row sum kernel where it serves this shape (its tile: `config`,
        else fold_config's "in" entry), else the norm's kernel and then `linear`."""
        from pdserve.ops.linear import linear
        if _sum_config(self.hw, weight) is None:
            return linear(self.materialize(), weight, bias)
        n, k = weight.shape
        cfg = config or fold_config(n, k, "in", self.hw.device)
        out = torch.empty((1, n), dtype=self.h.dtype, device=self.h.device)
        if n == 0:
            return out
        p = self.partials.shape[0]
        _skinny_sum_kernel[(triton.cdiv(n, cfg.block_n),)](
            self.hw, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PartIn=self.partials, n_part_in=p, eps=float(self.eps),
            BLOCK_P=triton.next_power_of_2(p), PREFETCH=cfg.prefetch, num_stages=cfg.num_stages,
            num_warps=cfg.num_warps, **pdl_args(self.hw))
        return out


def _sum_config(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | None:
    """The one-row sum tile for x [1, K] @ weight [N, K]^T where the skinny kernel serves it, else None."""
    if not (_enabled and x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == weight.shape[1] and x.is_contiguous()
            and use_skinny(x, weight)):
        return None
    cfg = skinny_config(weight.shape[0], weight.shape[1], 1, x.device)
    return cfg if cfg.kind == "sum" else None


def can_produce(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `produce` takes x (one row; for `gated`, a merged gate_up row [1, 2K]) @ weight^T."""
    k = weight.shape[1]
    if gated:
        if x.dim() != 2 or x.shape != (1, 2 * k) or not x.is_contiguous():
            return False
        x = x[:, :k]
    return _sum_config(x.contiguous() if gated else x, weight) is not None


def produce(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
            offset: float = 0.0, act: str | None = None, config: SkinnyConfig | None = None) -> NormedRow:
    """norm(x @ weight^T + residual) left for the next product (NormedRow), with `act`: x is a merged gate_up row
    and the input is act(gate) * up (pdserve.ops.linear.act_linear's fold). The caller checks `can_produce`. The
    tile: `config`, else fold_config's "out" entry ("act_out" with `act`)."""
    n, k = weight.shape
    gated = act is not None
    cfg = _sum_config(x[:, :k].contiguous() if gated else x, weight)
    if cfg is None or residual.shape != (1, n) or not residual.is_contiguous():
        raise ValueError(f"norm_fold.produce takes one row through the sum kernel and a [1, {n}] residual; got "
                         f"{tuple(x.shape)} @ {tuple(weight.shape)}^T with residual {tuple(residual.shape)}")
    cfg = config or fold_config(n, k, "act_out" if gated else "out", x.device)
    grid = triton.cdiv(n, cfg.block_n)
    h = torch.empty((1, n), dtype=x.dtype, device=x.device)
    hw = torch.empty_like(h)
    partials = torch.empty((grid,), dtype=torch.float32, device=x.device)
    extra = dict(GATED=True, ACT=act) if gated else {}
    _skinny_sum_kernel[(grid,)](
        x, weight, weight, h, n, k, weight.stride(0), HAS_BIAS=False, EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, Res=residual, NormW=norm_weight,
        offset=float(offset), HGOut=hw, PartOut=partials, NORM_OUT=True, PREFETCH=cfg.prefetch,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps, **extra, **pdl_args(x))
    return NormedRow(h, hw, partials, norm_weight, eps, offset)

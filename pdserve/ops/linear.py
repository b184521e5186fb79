"""y = x @ W^T (+ b) for the few-row steps of decoding: a Triton kernel that streams W once, and cuBLAS for the rest.

A decode step at batch 1 reads every weight once and does almost no arithmetic, so its time is the weights' bytes
over the rate the GEMM kernel reads them at. cuBLAS's kernels for a handful of rows read the small projections of an
8B model (q/k/v, o, down) well below the card's copy rate (benchmarks/engine/bench_linear.py measures both in the
same run). The skinny kernel gives each program `block_n` output columns and sweeps the whole of K, so no split-K
reduction kernel follows it:

- `dot`: a 16-row tile of x (rows past M masked to zero) times a [block_n, block_k] tile of W on the tensor cores;
  any M up to 16.
- `sum`: for one row, each W tile multiplied by x and summed along K in registers (no shared-memory round trip).

Which tile (or cuBLAS) serves which (N, K, rows) comes from a table measured on the card: `PDSERVE_SKINNY_CONFIG`'s
file, or the one shipped for the GPU (configs/skinny_linear/, written by bench_linear.py --best-out), else the
defaults below. `linear` routes rows <= `SKINNY_MAX_ROWS` of 16-bit CUDA tensors here and everything else to
`F.linear`, which stays the reference.

The activation folded in (one row): `act_linear` runs act(gate) * up of the merged gate_up row inside the down
projection's sum kernel, rounded as the activation's kernel stores it: one kernel fewer per layer in a batch-1
decode step (benchmarks/lease_s19/s19d: the batch-1 loops 0.16-0.17 ms faster a step on an H200). The RMS norm folded
the same way into the q/k/v and gate_up products was slower (every program re-reads the row, its residual and the
norm's weight from L2: 6,144 programs of gate_up's one-row tile). pdserve.ops.norm_fold folds it another way: the
product before the norm adds the residual and sums the squares of its own columns, and the product after it scales
its sums by 1 / rms at the end. More rows, CPU tensors or `set_fold(False)`: the activation's kernel, then `linear`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve import envs
from pdserve.ops.activation import act_and_mul
from pdserve.ops.dispatch import HAS_TRITON, use_fused
from pdserve.ops.pdl import pdl_args

SKINNY_MAX_ROWS = 16  # the dot tile's row count: every M up to it shares one compiled kernel


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch shape of the skinny kernel: output columns per program, K per inner step, warps, pipeline
    stages, and the inner product (`dot` for any M <= 16, `sum` for M == 1 only). `cublas` in a measured table:
    that shape measured faster through F.linear, which `linear` then calls. `prefetch` (the sum kernel): each step
    issues the next weight tile's load before its own products (a register double buffer)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    kind: str = "dot"
    prefetch: bool = False


# Without a measured entry: one row through the sum kernel with 8 columns and 1024 of K a program, the tile whose
# time was best over Qwen3-8B's and Qwen3-30B-A3B's projections on an H200 (1.16x cuBLAS geomean, >= 1.01x on each:
# benchmarks/lease_s12/skinny); more rows through cuBLAS (no dot tile beat it across those shapes at 8 rows).
DEFAULT_CONFIG = SkinnyConfig()
ONE_ROW_CONFIG = SkinnyConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3, kind="sum")
CUBLAS = SkinnyConfig(kind="cublas")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.ops.activation import act_mul
    from pdserve.ops.pdl import pdl_launch_early, pdl_wait

    @triton.jit(do_not_specialize=["M"])  # one binary for every M up to 16 (decode graphs of 1..16 rows)
    def _skinny_dot_kernel(X, W, B, Out, M, N, K, s_xm, s_wn, s_om, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                           EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, 16)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        mmask = rm < M
        w_ptrs = W + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]
        x_ptrs = X + rm[:, None] * s_xm + rk[None, :]
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                if EVEN_N:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            else:
                kmask = (k + rk) < K
                w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rm[:, None] * s_om + rn[None, :], acc.to(Out.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _x_chunk(X, k, rk, kmask, K, GATED: tl.constexpr, ACT: tl.constexpr, MASKED: tl.constexpr):
        """One BLOCK_K chunk of the product's input in float32: x, or (GATED) act(gate) * up of a merged gate_up
        row [2K], rounded as pdserve.ops.activation's kernel stores it."""
        if MASKED:
            x = tl.load(X + k + rk, mask=kmask, other=0.0)
        else:
            x = tl.load(X + k + rk)
        if GATED:
            if MASKED:
                u = tl.load(X + K + k + rk, mask=kmask, other=0.0).to(tl.float32)
            else:
                u = tl.load(X + K + k + rk).to(tl.float32)
            x = act_mul(x.to(tl.float32), u, ACT).to(X.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _w_tile(w_ptrs, k, rk, nmask, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        """The weight tile at K offset k (w_ptrs already there): nothing loaded past K or N (a scalar mask where K
        is a multiple of the tile, so the loads stay vectorized)."""
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs, mask=k < K, other=0.0)
            else:
                w = tl.load(w_ptrs, mask=nmask[:, None] & (k < K), other=0.0)
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & ((k + rk) < K)[None, :], other=0.0)
        return w

    @triton.jit
    def _skinny_sum_kernel(X, W, B, Out, N, K, s_wn, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                           EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                           GATED: tl.constexpr = False, ACT: tl.constexpr = "silu",
                           PartIn=None, n_part_in=0, eps=0.0, BLOCK_P: tl.constexpr = 0,
                           Res=None, NormW=None, offset=0.0, HGOut=None, PartOut=None, NORM_OUT: tl.constexpr = False,
                           PREFETCH: tl.constexpr = False):
        """One row: X [K], or (GATED) a merged gate_up row [2K] whose act(gate) * up is the input.

        The weight tiles' loads go straight to registers (Triton's pipeliner stages only loads that feed a dot), so
        without PREFETCH a step's products wait for its own tile. PREFETCH carries the next tile in registers: its
        load is issued before this step's products, two tiles in flight a program.

        BLOCK_P > 0 (the RMS norm folded in, input side, pdserve.ops.norm_fold): X is h * w of the norm's input h,
        PartIn the n_part_in partial sums of h's squares; the product is scaled by rsqrt(mean(h^2) + eps) at the
        end. NORM_OUT (output side): Out gets h = Res + the product (the residual stream, rounded as the add+RMSNorm
        kernel rounds), HGOut h * (NormW + offset), PartOut[program] the program's sum of h^2."""
        pdl_launch_early(PDL)
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        w_ptrs = W + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PREFETCH:
            # the first tile before the wait (it streams in under the previous kernel's tail with PDL), then each
            # step loads the next (nothing past K) before its own products
            w_cur = _w_tile(w_ptrs, 0, rk, nmask, K, EVEN_N, EVEN_K)
            pdl_wait(PDL)
            for k in range(0, K, BLOCK_K):
                w_ptrs += BLOCK_K
                w_nxt = _w_tile(w_ptrs, k + BLOCK_K, rk, nmask, K, EVEN_N, EVEN_K)
                kmask = (k + rk) < K
                acc += w_cur.to(tl.float32) * _x_chunk(X, k, rk, kmask, K, GATED, ACT, not EVEN_K)[None, :]
                w_cur = w_nxt
        else:
            k0 = 0
            if PDL != 0:  # the first weight tile streams in under the previous kernel's tail (see pdserve.ops.pdl)
                kmask = rk < K
                w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
                pdl_wait(PDL)
                acc += w.to(tl.float32) * _x_chunk(X, 0, rk, kmask, K, GATED, ACT, True)[None, :]
                w_ptrs += BLOCK_K
                k0 = BLOCK_K
            for k in range(k0, K, BLOCK_K):
                kmask = (k + rk) < K
                if EVEN_K:
                    if EVEN_N:
                        w = tl.load(w_ptrs)
                    else:
                        w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
                else:
                    w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc += w.to(tl.float32) * _x_chunk(X, k, rk, kmask, K, GATED, ACT, not EVEN_K)[None, :]
                w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
        if BLOCK_P > 0:  # the norm's 1 / rms, from the previous product's partial sums of squares
            rp = tl.arange(0, BLOCK_P)
            ssq = tl.sum(tl.load(PartIn + rp, mask=rp < n_part_in, other=0.0), 0)
            y = y * tl.rsqrt(ssq / K + eps)
        if HAS_BIAS:
            y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
        if NORM_OUT:
            r = tl.load(Res + rn, mask=nmask, other=0.0).to(tl.float32)
            h = (y.to(Out.dtype.element_ty).to(tl.float32) + r).to(Out.dtype.element_ty)
            tl.store(Out + rn, h, mask=nmask)
            hf = tl.where(nmask, h.to(tl.float32), 0.0)
            nw = tl.load(NormW + rn, mask=nmask, other=0.0).to(tl.float32) + offset
            tl.store(HGOut + rn, (hf * nw).to(Out.dtype.element_ty), mask=nmask)
            tl.store(PartOut + pid, tl.sum(hf * hf, 0))
        else:
            tl.store(Out + rn, y.to(Out.dtype.element_ty), mask=nmask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SKINNY_MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear takes x [M<={SKINNY_MAX_ROWS}, K] and weight [N, K] with unit stride "
                         f"along K; got {tuple(x.shape)} @ {tuple(weight.shape)}^T")
    cfg = config or skinny_config(n, k, m, x.device)
    if cfg.kind == "cublas":
        cfg = ONE_ROW_CONFIG if m == 1 else replace(DEFAULT_CONFIG)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    grid = (triton.cdiv(n, cfg.block_n),)
    b = bias if bias is not None else weight  # never read without HAS_BIAS
    common = dict(HAS_BIAS=bias is not None, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_stages=cfg.num_stages, num_warps=cfg.num_warps)
    if cfg.kind == "sum" and m == 1:
        _skinny_sum_kernel[grid](x, weight, b, out, n, k, weight.stride(0), **common, PREFETCH=cfg.prefetch,
                                 **pdl_args(x))
    elif cfg.kind in ("dot", "sum"):
        # never with PDL: its shared memory, held while waiting, crowds out the kernel before it (pdserve.ops.pdl)
        _skinny_dot_kernel[grid](x, weight, b, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), **common)
    else:
        raise ValueError(f"skinny_linear has no kernel {cfg.kind!r}")
    return out


def skinny_act_linear(gate_up: torch.Tensor, act: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: SkinnyConfig | None = None) -> torch.Tensor:
    """act(gate) * up @ weight^T (+ bias) for one contiguous merged row gate_up [1, 2K], in one kernel: the
    activation's own kernel folded into the product's (pdserve.ops.activation's math and rounding)."""
    n, k = weight.shape
    if gate_up.shape != (1, 2 * k) or not gate_up.is_contiguous() or act not in ("silu", "gelu_tanh", "gelu"):
        raise ValueError(f"skinny_act_linear takes one contiguous gate_up row [1, 2K] and silu, gelu_tanh or gelu; "
                         f"got {tuple(gate_up.shape)} with weight {tuple(weight.shape)} and {act!r}")
    cfg = config or fold_config(n, k, "act", gate_up.device)
    cfg = cfg if cfg.kind == "sum" else ONE_ROW_CONFIG
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    _skinny_sum_kernel[(triton.cdiv(n, cfg.block_n),)](
        gate_up, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GATED=True, ACT=act, PREFETCH=cfg.prefetch, num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        **pdl_args(gate_up))
    return out


CONFIG_DIR = Path(__file__).parent / "configs" / "skinny_linear"


@lru_cache(maxsize=8)
def _load_table(path: str) -> dict:
    with open(path) as f:
        raw = json.load(f)
    return {key: SkinnyConfig(**val) for key, val in raw.items() if not key.startswith("_")}  # "_source": provenance


@lru_cache(maxsize=8)
def _device_table(device_index: int) -> dict:
    """The table shipped for this GPU (configs/skinny_linear/device=<name>.json, measured by bench_linear.py), or
    an empty one."""
    name = torch.cuda.get_device_name(device_index).replace(" ", "_")
    path = CONFIG_DIR / f"device={name}.json"
    return _load_table(str(path)) if path.is_file() else {}


def skinny_config(n: int, k: int, m: int = 1, device: torch.device | None = None) -> SkinnyConfig:
    """The tile for an [M, K] @ [N, K]^T product. Tables, first match wins: PDSERVE_SKINNY_CONFIG's file, then the
    one shipped for this GPU; in each, "N,K,m1" (one row only), "N,K" (any rows up to 16), then "default". Without
    an entry: ONE_ROW_CONFIG for one row (it beat cuBLAS on every shape measured), cuBLAS for more."""
    return _config(n, k, m == 1, _index(device), envs.skinny_config_file())


# The one-row sum kernel with work folded in, by what it takes on (each its own binary, with its own best tile):
# "act" the activation of a merged gate_up row (skinny_act_linear), "in" the RMS norm's scale from the partial sums
# of the product before it (pdserve.ops.norm_fold.NormedRow.linear), "out" the residual add and the norm's parts
# (norm_fold.produce), "act_out" both of the last two (the down projection in a batch-1 step). A folded kernel does
# per-program work the plain one does not: "act" and "act_out" compute the activation over all of K in every program,
# "in" sums the producer's partials, so its best tile need not be the plain product's (benchmarks/lease_s29/s29c: wider
# tiles for o and gate_up on an H200, the batch-1 loops 0.05-0.06 ms a step faster).
FOLDS = ("act", "in", "out", "act_out")


def fold_config(n: int, k: int, fold: str, device: torch.device | None = None) -> SkinnyConfig:
    """The tile of the one-row sum kernel with `fold` (FOLDS) for an [N, K] weight: a table's "N,K,m1,<fold>" entry
    (a sum tile; tables in skinny_config's order) where one names it, else the plain one-row tile. The caller has
    checked that the plain one-row tile is the sum kernel's (the fold's condition)."""
    if fold not in FOLDS:
        raise ValueError(f"fold_config takes one of {FOLDS}, got {fold!r}")
    return _config(n, k, True, _index(device), envs.skinny_config_file(), fold)


def _index(device: torch.device | None) -> int | None:
    if device is not None and device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    return None


@lru_cache(maxsize=1024)
def _config(n: int, k: int, one_row: bool, device_index: int | None, path: str | None, fold: str = ""
            ) -> SkinnyConfig:
    """skinny_config's and fold_config's lookup, once per shape (an eager step asks for every layer's
    projections)."""
    tables = [_load_table(path)] if path else []
    if device_index is not None:
        tables.append(_device_table(device_index))
    keys = ((f"{n},{k},m1,{fold}",) if fold else ()) + ((f"{n},{k},m1",) if one_row else ()) + (f"{n},{k}", "default")
    for table in tables:
        for key in keys:
            if key in table:
                cfg = table[key]
                if fold and key == keys[0] and cfg.kind != "sum":
                    continue  # a folded product runs the sum kernel only
                if one_row or cfg.kind != "sum":
                    return cfg
                return replace(cfg, kind="dot", block_n=max(16, cfg.block_n))
    return ONE_ROW_CONFIG if one_row else CUBLAS


_enabled = True


def set_skinny(enabled: bool) -> bool:
    """Route few-row products to the skinny kernel (default) or always to F.linear (an A/B in one process);
    returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, enabled
    return prev


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_enabled and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and use_fused(x)
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with rows <= SKINNY_MAX_ROWS of a 16-bit CUDA tensor through the skinny kernel."""
    if use_skinny(x, weight):
        cfg = skinny_config(weight.shape[0], weight.shape[1], x.shape[0], x.device)
        if cfg.kind != "cublas":
            return skinny_linear(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


_fold = True


def set_fold(enabled: bool) -> bool:
    """Fold the activation into a one-row down projection's kernel (default), or run it as a kernel of its own
    (an A/B in one process); returns the previous setting."""
    global _fold
    prev, _fold = _fold, enabled
    return prev


def act_folds() -> bool:
    """Whether one-row down projections take the activation into their kernel (set_fold)."""
    return _fold


def act_linear(gate_up: torch.Tensor, act: str, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """linear(act(gate) * up) of a merged gate_up [T, 2K]: one kernel for one contiguous row whose product the
    one-row sum kernel runs (skinny_act_linear); otherwise the activation's kernel, then `linear`."""
    k = weight.shape[1]
    if (_fold and gate_up.shape[0] == 1 and gate_up.shape[-1] == 2 * k and gate_up.is_contiguous()
            and use_skinny(gate_up[:, :k], weight)
            and skinny_config(weight.shape[0], k, 1, gate_up.device).kind == "sum"):
        return skinny_act_linear(gate_up, act, weight, bias)
    return linear(act_and_mul(gate_up, act), weight, bias)

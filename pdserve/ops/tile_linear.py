"""y = x @ W^T (+ b) for a few hundred rows (a large decode batch, a small mixed step): a Triton tile GEMM with the
output tile chosen per shape and row count from a table measured on the card.

At 256 rows cuBLAS tiles an [M, 4096] output with 128x128 tiles: 2 x 32 = 64 programs on a 132-SM card, so the o and
down projections of an 8B model run at 60-76 % of their floor (benchmarks/engine/bench_gemm_rows.py; lease_s17). A
tile of 128x64 (or 64x128) gives 128 programs and fills the card. Each program sweeps the whole of K (no split-K
reduction kernel follows); program p takes row tile p % row_tiles of column tile p // row_tiles, so the programs that
share a weight tile run together and the second reads it from L2. The last row tile's rows past M re-read rows from
the top (row index mod M) instead of masking the loads, and are not stored.

Which tile (or cuBLAS) serves which (N, K, rows) comes from `PDSERVE_TILE_LINEAR_CONFIG`'s file, else the one shipped
for the GPU (configs/tile_linear/device=<name>.json, written by benchmarks/engine/bench_tile_linear.py --best-out):
entries "N,K,R" say what serves M rows for the smallest measured R >= M. A shape or row count with no entry stays
with cuBLAS (`F.linear`, also the reference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from pdserve import envs
from pdserve.ops.dispatch import HAS_TRITON

MIN_ROWS = 17  # fewer rows: pdserve.ops.linear's skinny kernel (or cuBLAS)
MAX_ROWS = 1024  # more rows fill the card with cuBLAS's own tiles (97-103 % of the floor at 768+ rows, lease_s17)


@dataclass(frozen=True)
class TileConfig:
    """One launch shape: the output tile (block_m rows x block_n columns), K per inner step, warps, pipeline stages.
    kind `cublas` in a measured table: F.linear measured faster for that shape and row count."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    kind: str = "tile"


CUBLAS = TileConfig(kind="cublas")

_enabled = True


def set_tile_linear(enabled: bool) -> bool:
    """Route measured (shape, rows) products to the tile kernel (default) or always to F.linear (an A/B in one
    process); returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, enabled
    return prev


def tile_enabled() -> bool:
    return _enabled

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary for every row count (the decode and mixed graph sizes)
    def _tile_kernel(X, W, B, Out, M, N, K, s_xm, s_wn, s_om, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        row_tiles = tl.cdiv(M, BLOCK_M)
        pid_m = pid % row_tiles
        pid_n = pid // row_tiles
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = X + (rm % M).to(tl.int64)[:, None] * s_xm + rk[None, :]
        w_ptrs = W + (rn % N).to(tl.int64)[:, None] * s_wn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs)
            else:
                kmask = (k + rk) < K
                x = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rm.to(tl.int64)[:, None] * s_om + rn[None, :], acc.to(Out.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: TileConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, on the tile kernel
    (`config`, or the measured table's tile for this shape; TileConfig() where it names none)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"tile_linear takes x [M, K] and weight [N, K] with unit stride along K; got "
                         f"{tuple(x.shape)} @ {tuple(weight.shape)}^T")
    cfg = config or tile_config(n, k, m, x.device)
    if cfg.kind == "cublas":
        cfg = TileConfig()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _tile_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0),
                       out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


CONFIG_DIR = Path(__file__).parent / "configs" / "tile_linear"


@lru_cache(maxsize=8)
def _load_table(path: str) -> dict[tuple[int, int], list[tuple[int, TileConfig]]]:
    """{(N, K): [(rows, config), ...] by rows} from a file of {"N,K,R": {...}} ("_source" and other "_" keys skipped)."""
    with open(path) as f:
        raw = json.load(f)
    table: dict[tuple[int, int], list[tuple[int, TileConfig]]] = {}
    for key, val in raw.items():
        if key.startswith("_"):
            continue
        n, k, r = (int(v) for v in key.split(","))
        table.setdefault((n, k), []).append((r, TileConfig(**val)))
    return {nk: sorted(rows, key=lambda e: e[0]) for nk, rows in table.items()}


@lru_cache(maxsize=8)
def _device_table(device_index: int) -> dict:
    name = torch.cuda.get_device_name(device_index).replace(" ", "_")
    path = CONFIG_DIR / f"device={name}.json"
    return _load_table(str(path)) if path.is_file() else {}


def tile_config(n: int, k: int, m: int, device: torch.device | None = None) -> TileConfig:
    """What serves an [M, K] @ [N, K]^T product: the first table with an entry for (N, K) (PDSERVE_TILE_LINEAR_CONFIG's
    file, then the one shipped for this GPU) gives the entry of the smallest measured row count >= M; cuBLAS where
    there is none, or M is outside [MIN_ROWS, MAX_ROWS]."""
    index = None
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _config(n, k, m, index, envs.tile_linear_config_file())


@lru_cache(maxsize=4096)
def _config(n: int, k: int, m: int, device_index: int | None, path: str | None) -> TileConfig:
    if not MIN_ROWS <= m <= MAX_ROWS:
        return CUBLAS
    tables = [_load_table(path)] if path else []
    if device_index is not None:
        tables.append(_device_table(device_index))
    for table in tables:
        if (n, k) in table:
            return next((cfg for rows, cfg in table[(n, k)] if rows >= m), CUBLAS)
    return CUBLAS

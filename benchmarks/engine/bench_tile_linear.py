"""Linear products of a few hundred rows (large decode batches, small mixed steps) on this GPU: cuBLAS (torch.mm)
against a Triton tile GEMM (below) over a model's projection shapes, each against its floor (FLOPs at the matmul
rate, the weight at the HBM copy rate, both measured in the same run).

Why: at 256 rows cuBLAS tiles an [M, 4096] output with 128x128 tiles, 2 x 32 = 64 programs on a 132-SM card, and the
o and down projections of an 8B model ran at 60-76 % of their floor (bench_gemm_rows.py, lease_s17). This kernel
gives each program one output tile (block_m x block_n, e.g. 128x64: 128 programs) and the whole of K; program p takes
row tile p % row_tiles of column tile p // row_tiles, so programs sharing a weight tile run together. The last row
tile's rows past M re-read rows from the top (index mod M) instead of masking loads, and are not stored.

Result (lease_s18/s18a, H200): it lost to cuBLAS at every shape and row count from 32 to 1024 rows except lm_head at
64 rows (3.5 %); at 256 rows it took 1.23-1.53x cuBLAS's time, so pdserve's engine does not use it (it was wired in at commit eba5aa1 and
taken out after this measurement). A competitive kernel would need TMA loads and warp specialisation.

Each timing replays a CUDA graph of calls over distinct copies of the weight (together larger than L2, as the layers
of a step are), so every call reads its weight from HBM and pays the gaps of a graph, as in a step.

    python benchmarks/engine/bench_tile_linear.py --model qwen3-8b,qwen3-30b-a3b --best-out tile.json --out tiles.json

`--best-out` writes per shape and row count "N,K,R" the fastest tile where it beat cuBLAS by more than --margin, else
kind "cublas". Every tile written is first checked against torch.mm on the same operands.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json


@dataclass(frozen=True)
class TileConfig:
    """One launch shape: the output tile (block_m rows x block_n columns), K per inner step, warps, pipeline stages;
    kind `cublas` in the written table: torch.mm measured faster for that shape and row count."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    kind: str = "tile"


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
    (`config`, else TileConfig())."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"tile_linear takes x [M, K] and weight [N, K] with unit stride along K; got "
                         f"{tuple(x.shape)} @ {tuple(weight.shape)}^T")
    if min(m, n, k) == 0:
        raise ValueError("tile_linear (a benchmark's kernel) takes no empty operand")
    cfg = config or TileConfig()
    out = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _tile_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0),
                       out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


PRESETS = {
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
                 ("lm_head", 151936, 4096)],
    "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("lm_head", 151936, 2048)],
}

TILES = [TileConfig(bm, bn, bk, 4, s) for bm, bn, bk, s in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4))]
TILES += [TileConfig(128, 128, 64, 8, s) for s in (3, 4)]
TILES += [TileConfig(256, bn, 64, 8, 3) for bn in (32, 64)]
TILES += [TileConfig(64, 256, 64, 8, 3)]


def _compile(cfgs: list[dict], shapes: list[tuple[int, int]]) -> int:
    """Worker: run each tile once per shape so its binaries land in Triton's on-disk cache."""
    failed = 0
    for c in cfgs:
        cfg = TileConfig(**c)
        for n, k in shapes:
            w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
            try:
                tile_linear(torch.zeros(64, k, device="cuda", dtype=torch.bfloat16), w, None, cfg)
            except Exception:
                failed += 1
            del w
    torch.cuda.synchronize()
    return failed


def precompile(cands: list[TileConfig], shapes: list[tuple[int, int]], procs: int) -> None:
    import multiprocessing as mp

    chunks = [[asdict(c) for c in cands[i::procs]] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.starmap(_compile, [(ch, shapes) for ch in chunks if ch]))
    print(f"precompiled {len(cands)} tiles in {procs} processes ({failed} launches failed)", flush=True)


def _close(cfg: TileConfig, n: int, k: int, m: int) -> float:
    """Largest |tile - torch.mm| over the output, relative to the largest |torch.mm|."""
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = torch.mm(x, w.t()).float()
    return float((tile_linear(x, w, None, cfg).float() - ref).abs().max() / ref.abs().max())


def _time(case: dict, label: str, fn, x, weights, out, results: list, cfg: TileConfig | None = None) -> dict:
    """One implementation's microseconds a call (graph_us over the weight copies), appended to `results`."""
    r = {**case, "impl": label}
    if cfg is not None:
        r["config"] = asdict(cfg)
    try:
        us = graph_us([functools.partial(fn, x, w, out) for w in weights])
    except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
        r["error"] = repr(e)[:200]
    else:
        r.update(us=us, of_floor=case["floor_us"] / us, tflops=case["flops"] / (us * 1e-6) / 1e12)
    results.append(r)
    return r


def bench_shape(model: str, name: str, n: int, k: int, rows: list[int], tiles: list[TileConfig], ceil: dict,
                args) -> tuple[list[dict], dict]:
    nbytes = n * k * 2
    copies = max(2, -(-args.min_bytes // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = torch.empty(max(rows), n, device="cuda", dtype=torch.bfloat16)
    results, table = [], {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        floor = max(flops / (ceil["bf16_matmul_tflops"] * 1e12), (nbytes + 2 * m * (n + k)) / (ceil["hbm_copy_gbps"] * 1e9)) * 1e6

        case = {"model": model, "shape": name, "n": n, "k": k, "rows": m, "floor_us": floor, "flops": flops}
        base = _time(case, "cublas", lambda x, w, o: torch.mm(x, w.t(), out=o), x, weights, out[:m], results)
        mine = [_time(case, f"tile:{c}", lambda x, w, o, c=c: tile_linear(x, w, None, c, out=o), x, weights, out[:m],
                      results, c) for c in tiles]
        ok = [r for r in mine if "us" in r]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        key = f"{n},{k},{m}"
        if best is not None and best["us"] < base["us"] * (1 - args.margin):
            cfg = TileConfig(**best["config"])
            err = _close(cfg, n, k, m)
            if err < 2e-2:
                table[key] = asdict(cfg)
            else:
                print(f"  {key}: tile {cfg} off by {err:.3g} of the output's range: not used", flush=True)
                table[key] = asdict(TileConfig(kind="cublas"))
        else:
            table[key] = asdict(TileConfig(kind="cublas"))
        bt = f"tile {best['us']:8.2f} us ({best['of_floor']:.0%}) {best['config']}" if best else "no tile ran"
        print(f"{model:14s} {name:8s} {n:6d}x{k:<6d} rows {m:5d}: floor {floor:8.2f} us | cuBLAS {base['us']:8.2f} us "
              f"({base['of_floor']:.0%}) | {bt} -> {table[key]['kind']}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return results, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", help="comma-separated: " + ", ".join(sorted(PRESETS)))
    ap.add_argument("--rows", default="32,64,96,128,160,192,224,256,320,384,512,768,1024")
    ap.add_argument("--margin", type=float, default=0.03, help="a tile is written only if faster than cuBLAS by this")
    ap.add_argument("--layers", default="qwen3-8b=36,qwen3-30b-a3b=48", help="layers a step runs each projection in")
    ap.add_argument("--min-bytes", type=int, default=768 << 20, help="weight copies per shape: at least this much")
    ap.add_argument("--precompile-procs", type=int, default=8)
    ap.add_argument("--best-out", default=None)
    ap.add_argument("--out", default="tile_linear.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tile_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    models = args.model.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    layers = dict(kv.split("=") for kv in args.layers.split(","))
    ceil = {"gpu": torch.cuda.get_device_name(), "hbm_copy_gbps": hbm_copy_gbps(), "bf16_matmul_tflops": matmul_tflops()}
    print(f"ceilings: {ceil}", flush=True)
    shapes = sorted({(n, k) for mdl in models for _, n, k in PRESETS[mdl]})
    if args.precompile_procs > 1:
        precompile(TILES, shapes, args.precompile_procs)
    torch.manual_seed(0)
    results, table = [], {"_source": f"benchmarks/engine/bench_tile_linear.py on {ceil['gpu']}"}
    done = set()
    for mdl in models:
        for name, n, k in PRESETS[mdl]:
            if (n, k) in done:
                continue
            done.add((n, k))
            res, tab = bench_shape(mdl, name, n, k, rows, TILES, ceil, args)
            results += res
            table.update(tab)
            if args.best_out:  # after each shape: a run cut short still leaves the shapes it measured
                with open(args.best_out, "w") as f:
                    json.dump(table, f, indent=1)
    for mdl in models:  # per row count: the step's products (each projection x layers, lm_head once) both ways
        nl = int(layers.get(mdl, 1))
        for m in rows:
            cub = best = 0.0
            for name, n, k in PRESETS[mdl]:
                rs = [r for r in results if r["n"] == n and r["k"] == k and r["rows"] == m and "us" in r]
                c = next(r["us"] for r in rs if r["impl"] == "cublas")
                use = c if table[f"{n},{k},{m}"]["kind"] == "cublas" else min(r["us"] for r in rs)
                times = 1 if name == "lm_head" else nl
                cub, best = cub + c * times, best + use * times
            print(f"{mdl} rows {m}: the step's products {cub / 1e3:.3f} ms on cuBLAS, {best / 1e3:.3f} ms with the "
                  f"table ({cub / best:.3f}x)", flush=True)
    rec = new_record("tile_linear", vars(args))
    rec.update(ceilings=ceil, results=results, table=table)
    save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

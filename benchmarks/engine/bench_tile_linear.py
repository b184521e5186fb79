"""Linear products of a few hundred rows (large decode batches, small mixed steps) on this GPU: cuBLAS (torch.mm)
against the tile Triton kernel (pdserve.ops.tile_linear) over a model's projection shapes, each against its floor
(FLOPs at the matmul rate, the weight at the HBM copy rate, both measured in the same run).

Each timing replays a CUDA graph of calls over distinct copies of the weight (together larger than L2, as the layers
of a step are), so every call reads its weight from HBM and pays the gaps of a graph, as in a step.

    python benchmarks/engine/bench_tile_linear.py --model qwen3-8b,qwen3-30b-a3b --best-out tile.json --out tiles.json

`--best-out` writes the table `PDSERVE_TILE_LINEAR_CONFIG` reads (and configs/tile_linear/ ships): per shape and row
count "N,K,R" the fastest tile where it beat cuBLAS by more than --margin, else kind "cublas". Every tile written is
first checked against torch.mm on the same operands.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import asdict

import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json
from pdserve.ops.tile_linear import TileConfig, tile_linear

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

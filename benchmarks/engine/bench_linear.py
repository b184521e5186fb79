"""Few-row linear products (decode steps of 1..16 rows) on this GPU: cuBLAS (F.linear, and torch.mv for one row) and
the skinny Triton kernel (pdserve.ops.linear) over a model's projection shapes, against the HBM rates measured in
the same run.

Each timing replays a CUDA graph of calls over distinct copies of the weight (together larger than L2, as the
layers of a decode step are), so every call reads its weight from HBM and pays the gaps of a graph, as in a step.

    python benchmarks/engine/bench_linear.py --model qwen3-8b --sweep --best-out skinny.json --out linear.json

`--best-out` writes the table `PDSERVE_SKINNY_CONFIG` reads: per shape the fastest candidate for one row ("N,K,m1")
and for --table-rows rows ("N,K"); where cuBLAS measured fastest the entry says kind "cublas".

`--folds` times the one-row sum kernel as a batch-1 step runs it, with work folded in (pdserve.ops.linear.FOLDS:
the RMS norm's scale, the residual add and the norm's parts, the activation), over FOLD_SWEEP's tiles against the
tile serving takes (the shipped table's fold entry, else its plain one-row tile; session 29's s29c ran before the
table had fold entries); `--prefetch` adds each sum tile prefetching its next weight tile; `--fold-out` writes the
"N,K,m1,<fold>" entries that beat it by more than 1 %, merged into the shipped table (a file for
PDSERVE_SKINNY_CONFIG, or for configs/skinny_linear/ once measured in the loop).

    python benchmarks/engine/bench_linear.py --model qwen3-8b --rows 1 --folds --fold-out folds.json --out f.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
from dataclasses import asdict, replace

import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps
from pdserve.bench.record import new_record, save_json
from pdserve.ops import linear as lin
from pdserve.ops import norm_fold as nf
from pdserve.ops.linear import DEFAULT_CONFIG, ONE_ROW_CONFIG, SkinnyConfig, skinny_act_linear, skinny_linear

# (name, N, K) of each projection; q/k/v and gate/up are merged as pdserve serves them
PRESETS = {
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
                 ("lm_head", 151936, 4096)],
    "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("lm_head", 151936, 2048)],
}

DOT_SWEEP = [SkinnyConfig(bn, bk, w, s, "dot") for bn, bk, w, s in
             itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 5))]
DOT_SWEEP += [SkinnyConfig(bn, 512, 8, s, "dot") for bn, s in itertools.product((16, 32, 64), (3, 4, 5))]
SUM_SWEEP = [SkinnyConfig(bn, bk, w, s, "sum") for bn, bk, w, s in
             itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 3))]
# the folded products of each preset's batch-1 step (the model's norms folded, pdserve.ops.norm_fold; the activation
# folded into down): shape name -> fold
FOLD_PRESETS = {"qwen3-8b": {"qkv": "in", "o": "out", "gate_up": "in", "down": "act_out"}}
FOLD_SWEEP = [SkinnyConfig(bn, bk, w, s, "sum") for bn, bk, w, s in
              itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3))]
# --prefetch: every sum tile also with the next weight tile loaded a step ahead (SkinnyConfig.prefetch)
FOLD_PARTIALS = 1024  # the partial sums an "in" product reads (Qwen3-8B's o and down at 4 columns a program)


def fold_call(fold: str, cfg: SkinnyConfig, n: int, k: int):
    """fn(w) running the sum kernel with `fold` and tile `cfg` on weight w [n, k], its other inputs made here."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale
    x, gu, res, nw = rnd(1, k, scale=k ** -0.5), rnd(1, 2 * k), rnd(1, n), rnd(n)
    if fold == "in":
        row = nf.NormedRow(x, x, torch.rand(FOLD_PARTIALS, device="cuda", generator=g), rnd(k), 1e-6, 0.0)
        return lambda w: row.linear(w, config=cfg)
    if fold == "out":
        return lambda w: nf.produce(x, w, res, nw, 1e-6, config=cfg)
    if fold == "act_out":
        return lambda w: nf.produce(gu, w, res, nw, 1e-6, act="silu", config=cfg)
    if fold == "act":
        return lambda w: skinny_act_linear(gu, "silu", w, None, cfg)
    raise ValueError(f"no fold {fold!r}")


def _compile(cfgs: list[dict], shapes: list[tuple[str, int, int]], folds: dict | None = None) -> int:
    """Worker: run each tile once per shape (with `folds`: each shape's fold instead) so its binaries land in
    Triton's on-disk cache."""
    failed = 0
    if folds:
        for name, n, k in shapes:
            w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
            for c in cfgs:
                try:
                    fold_call(folds[name], SkinnyConfig(**c), n, k)(w)
                except Exception:
                    failed += 1
            del w
        torch.cuda.synchronize()
        return failed
    for c in cfgs:
        cfg = SkinnyConfig(**c)
        for _, n, k in shapes:
            w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
            for m in ((1, 8) if cfg.kind == "dot" else (1,)):
                try:
                    skinny_linear(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), w, None, cfg)
                except Exception:
                    failed += 1
            del w
    torch.cuda.synchronize()
    return failed


def precompile(cands: list[SkinnyConfig], shapes, procs: int, folds: dict | None = None) -> None:
    """Compile the candidates in `procs` processes at once (the sweep's time is otherwise mostly compiling)."""
    import multiprocessing as mp

    chunks = [[asdict(c) for c in cands[i::procs]] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.starmap(_compile, [(ch, shapes, folds) for ch in chunks if ch]))
    print(f"precompiled {len(cands)} tiles in {procs} processes ({failed} launches failed)", flush=True)


def hbm_read_gbps(nbytes: int = 4 << 30) -> float:
    """A reduction over a buffer far larger than L2: bytes read per second (nothing written back)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        src.amax()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return nbytes / (statistics.median(times) * 1e-3) / 1e9


def cublas(x, w, out):
    torch.mm(x, w.t(), out=out)


def cublas_mv(x, w, out):
    torch.mv(w, x[0], out=out[0])


def skinny(cfg: SkinnyConfig):
    return lambda x, w, out: skinny_linear(x, w, None, cfg, out=out)


def bench_shape(name: str, n: int, k: int, args, rows: list[int], ceil: dict, results: list, table: dict) -> None:
    """Time cuBLAS and the skinny tiles on one projection shape; add its rows to `results`, its entries to `table`."""
    nbytes = n * k * 2
    copies = max(2, -(-args.min_bytes // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)

    def run(label, fn, m, cfg=None):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        r = {"shape": name, "n": n, "k": k, "rows": m, "impl": label}
        try:
            us = graph_us([functools.partial(fn, x, w, out[:m]) for w in weights])
        except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
            r["error"] = repr(e)[:200]
        else:
            gbps = nbytes / (us * 1e-6) / 1e9
            r.update(us=us, gbps=gbps, of_copy=gbps / ceil["hbm_copy_gbps"], of_read=gbps / ceil["hbm_read_gbps"])
        if cfg is not None:
            r["config"] = asdict(cfg)
        results.append(r)
        return r

    base = {m: run("cublas", cublas, m) for m in sorted(set(rows) | {1, args.table_rows})}
    run("cublas_mv", cublas_mv, 1)
    cands = (DOT_SWEEP + _sums(SUM_SWEEP, args)) if args.sweep else [ONE_ROW_CONFIG, DEFAULT_CONFIG]
    best1 = min((run(f"skinny:{c}", skinny(c), 1, c) for c in cands), key=lambda r: r.get("us", 1e9))
    multi = min((run(f"skinny:{c}", skinny(c), args.table_rows, c) for c in cands if c.kind == "dot"),
                key=lambda r: r.get("us", 1e9))
    for key, best, m in ((f"{n},{k},m1", best1, 1), (f"{n},{k}", multi, args.table_rows)):
        table[key] = best["config"] if best.get("us", 1e9) < base[m]["us"] else asdict(replace(DEFAULT_CONFIG,
                                                                                               kind="cublas"))
    mcfg = SkinnyConfig(**multi["config"])
    for m in rows:
        if m not in (1, args.table_rows):
            run(f"skinny:{mcfg}", skinny(mcfg), m, mcfg)
    for m in sorted(set(rows) | {1, args.table_rows}):
        mine = [r for r in results if r["shape"] == name and r["rows"] == m and "us" in r
                and r["impl"].startswith("skinny")]
        best = min(mine, key=lambda r: r["us"]) if mine else None
        print(f"{name} {n}x{k} rows {m}: cuBLAS {base[m]['us']:.2f} us ({base[m]['of_read']:.0%} of read) | "
              + (f"skinny {best['us']:.2f} us ({best['of_read']:.0%} of read) {best['config']}" if best else "-"),
              flush=True)


def bench_folds(name: str, n: int, k: int, fold: str, ceil: dict, results: list, table: dict,
                cands: list[SkinnyConfig]) -> None:
    """Time the candidate tiles of the sum kernel with `fold` on one shape against the tile serving takes (the
    shipped fold entry, else the plain one-row tile); the best goes into `table` as "N,K,m1,<fold>" where it is more
    than 1 % faster."""
    nbytes = n * k * 2
    copies = max(2, -(-(768 << 20) // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    shipped = lin.fold_config(n, k, fold, torch.device("cuda"))  # PDSERVE_SKINNY_CONFIG unset: what serving takes

    def run(cfg, label):
        fn = fold_call(fold, cfg, n, k)
        r = {"shape": name, "n": n, "k": k, "rows": 1, "fold": fold, "impl": label, "config": asdict(cfg)}
        try:
            us = graph_us([functools.partial(fn, w) for w in weights])
        except Exception as e:
            r["error"] = repr(e)[:200]
        else:
            gbps = nbytes / (us * 1e-6) / 1e9
            r.update(us=us, gbps=gbps, of_copy=gbps / ceil["hbm_copy_gbps"])
        results.append(r)
        return r

    base = run(shipped, f"shipped:{shipped}")
    runs = [run(c, f"fold:{c}") for c in cands if c != shipped]
    best = min([base] + runs, key=lambda r: r.get("us", 1e9))
    if best is not base and best["us"] < 0.99 * base["us"]:
        table[f"{n},{k},m1,{fold}"] = best["config"]
    print(f"{name} {n}x{k} {fold}: shipped tile {base['us']:.2f} us ({base['of_copy']:.0%} of copy) {base['config']}"
          f" | best {best['us']:.2f} us ({best['of_copy']:.0%}) {best['config']}", flush=True)
    for r in sorted((r for r in runs if "us" in r), key=lambda r: r["us"])[:3]:
        print(f"    {r['us']:.2f} us {r['config']}", flush=True)


def _sums(tiles: list[SkinnyConfig], args) -> list[SkinnyConfig]:
    """The sum tiles, and with --prefetch each of them also prefetching."""
    return tiles + ([replace(c, prefetch=True) for c in tiles] if getattr(args, "prefetch", False) else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="1,2,4,8,16", help="row counts to report (comma-separated, each <= 16)")
    ap.add_argument("--sweep", action="store_true",
                    help="time every candidate tile at one row and at --table-rows rows (else only the two "
                         "defaults: ONE_ROW_CONFIG and DEFAULT_CONFIG)")
    ap.add_argument("--table-rows", type=int, default=8, help="rows at which the multi-row entry is chosen")
    ap.add_argument("--min-bytes", type=int, default=768 << 20,
                    help="weight copies per shape: at least this many bytes in all (L2 is 50-60 MB)")
    ap.add_argument("--precompile-procs", type=int, default=8, help="processes compiling the sweep's tiles first")
    ap.add_argument("--best-out", default=None, help="write the measured table (PDSERVE_SKINNY_CONFIG's format)")
    ap.add_argument("--folds", action="store_true",
                    help="time the folded one-row products of the model's batch-1 step (FOLD_PRESETS) instead")
    ap.add_argument("--fold-out", default=None,
                    help="with --folds: the shipped table with the measured fold entries added")
    ap.add_argument("--prefetch", action="store_true",
                    help="every sum tile also with the next weight tile loaded a step ahead (SkinnyConfig.prefetch)")
    ap.add_argument("--shipped-only", action="store_true",
                    help="with --folds: time only the tile serving takes (no sweep)")
    ap.add_argument("--pdl", choices=["early", "late", "off"], default="early",
                    help="programmatic dependent launch of the kernels (pdserve.ops.pdl; off: each launch waits for "
                         "the whole of the one before, so a graph of launches times each kernel's own span)")
    ap.add_argument("--out", default="linear.json")
    args = ap.parse_args(argv)
    from pdserve.ops.pdl import set_pdl
    set_pdl(args.pdl)
    if not torch.cuda.is_available():
        print("bench_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    rec = new_record("skinny_linear", vars(args))
    rec["ceilings"] = ceil = {"gpu": torch.cuda.get_device_name(), "hbm_copy_gbps": hbm_copy_gbps(),
                              "hbm_read_gbps": hbm_read_gbps()}
    print("ceilings:", ceil, flush=True)
    torch.manual_seed(0)
    if args.folds:
        return main_folds(args, rec, ceil)
    if args.sweep and args.precompile_procs > 1:
        precompile(DOT_SWEEP + _sums(SUM_SWEEP, args), PRESETS[args.model], args.precompile_procs)
    results, table = [], {}
    for name, n, k in PRESETS[args.model]:
        bench_shape(name, n, k, args, rows, ceil, results, table)
        torch.cuda.empty_cache()
    rec["results"], rec["table"] = results, table
    save_json(rec, args.out)
    if args.best_out:
        with open(args.best_out, "w") as f:
            json.dump(table, f, indent=1)
    print(json.dumps(table, indent=1))
    return 0


def main_folds(args, rec: dict, ceil: dict) -> int:
    """--folds: each folded shape's sweep; the fold entries, and the shipped table with them (--fold-out)."""
    if "PDSERVE_SKINNY_CONFIG" in os.environ:
        print("--folds compares against the shipped table: unset PDSERVE_SKINNY_CONFIG", file=sys.stderr)
        return 2
    folds = FOLD_PRESETS.get(args.model, {})
    shapes = [s for s in PRESETS[args.model] if s[0] in folds]
    cands = [] if args.shipped_only else _sums(FOLD_SWEEP, args)
    if cands and args.precompile_procs > 1:
        precompile(cands, shapes, args.precompile_procs, folds)
    results, table = [], {}
    for name, n, k in shapes:
        bench_folds(name, n, k, folds[name], ceil, results, table, cands)
        torch.cuda.empty_cache()
    rec["results"], rec["table"] = results, table
    save_json(rec, args.out)
    if args.fold_out:
        path = lin.CONFIG_DIR / f"device={torch.cuda.get_device_name().replace(' ', '_')}.json"
        shipped = json.loads(path.read_text()) if path.is_file() else {}
        with open(args.fold_out, "w") as f:
            json.dump({**shipped, **table}, f, indent=1)
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

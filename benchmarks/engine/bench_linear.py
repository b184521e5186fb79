"""Few-row linear products (decode steps of 1..16 rows) on this GPU: cuBLAS (F.linear, and torch.mv for one row) and
the skinny Triton kernel (pdserve.ops.linear) over a model's projection shapes, against the HBM rates measured in
the same run.

Each timing replays a CUDA graph of calls over distinct copies of the weight (together larger than L2, as the
layers of a decode step are), so every call reads its weight from HBM and pays the gaps of a graph, as in a step.

    python benchmarks/engine/bench_linear.py --model qwen3-8b --sweep --best-out skinny.json --out linear.json

`--best-out` writes the table `PDSERVE_SKINNY_CONFIG` reads: per shape the fastest candidate for one row ("N,K,m1")
and for --table-rows rows ("N,K"); where cuBLAS measured fastest the entry says kind "cublas".
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from dataclasses import asdict, replace

import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps
from pdserve.bench.record import new_record, save_json
from pdserve.ops.linear import DEFAULT_CONFIG, ONE_ROW_CONFIG, SkinnyConfig, skinny_linear

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


def _compile(cfgs: list[dict], shapes: list[tuple[str, int, int]]) -> int:
    """Worker: run each tile once per shape so its binaries land in Triton's on-disk cache."""
    failed = 0
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


def precompile(cands: list[SkinnyConfig], shapes, procs: int) -> None:
    """Compile the candidates in `procs` processes at once (the sweep's time is otherwise mostly compiling)."""
    import multiprocessing as mp

    chunks = [[asdict(c) for c in cands[i::procs]] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.starmap(_compile, [(ch, shapes) for ch in chunks if ch]))
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
    cands = (DOT_SWEEP + SUM_SWEEP) if args.sweep else [ONE_ROW_CONFIG, DEFAULT_CONFIG]
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
    ap.add_argument("--out", default="linear.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    rec = new_record("skinny_linear", vars(args))
    rec["ceilings"] = ceil = {"gpu": torch.cuda.get_device_name(), "hbm_copy_gbps": hbm_copy_gbps(),
                              "hbm_read_gbps": hbm_read_gbps()}
    print("ceilings:", ceil, flush=True)
    torch.manual_seed(0)
    if args.sweep and args.precompile_procs > 1:
        precompile(DOT_SWEEP + SUM_SWEEP, PRESETS[args.model], args.precompile_procs)
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


if __name__ == "__main__":
    sys.exit(main())

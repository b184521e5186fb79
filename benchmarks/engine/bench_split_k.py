"""o_proj and down_proj followed by their add+RMSNorm, as a decode or mixed step runs them: the plain product
(pdserve.ops.linear.linear: the skinny kernel up to 16 rows, cuBLAS above) then the norm, against the product split
over K into float32 parts (pdserve.ops.split_k) whose sum the norm does. Per row count, the faster; `--table-out`
writes the rows where a split won by more than `--margin` as the table pdserve.ops.split_k reads
(configs/split_k/device=<GPU>.json), runs of measured rows with the same winner merged into ranges.

Each timing replays a CUDA graph of (product, norm) pairs over distinct copies of the weight (together larger than
L2, as a step's layers are), so every product reads its weight from HBM, as in a step.

    python benchmarks/engine/bench_split_k.py --out $OUT/split_k.json --table-out $OUT/split_k_table.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json
from pdserve.ops.linear import linear
from pdserve.ops.norm import fused_add_rms_norm
from pdserve.ops.split_k import MAX_PARTS, split_linear

# (name, N, K) of the products an add+RMSNorm follows
PRESETS = {
    "qwen3-8b": [("o", 4096, 4096), ("down", 4096, 12288)],
    "qwen3-30b-a3b": [("o", 2048, 4096)],
}
ROWS = [1, 2, 4, 8, *range(16, 513, 16), 576, 640, 768, 1024]


def plain(x, w, res, nw):
    return fused_add_rms_norm(linear(x, w), res, nw, 1e-6)


def split(x, w, res, nw, parts):
    return fused_add_rms_norm(split_linear(x, w, parts), res, nw, 1e-6)


def bench_shape(name: str, n: int, k: int, rows: list[int], splits: list[int], min_bytes: int) -> list[dict]:
    copies = max(2, -(-min_bytes // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    nw = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref_out, ref_res = plain(x, weights[0], res, nw)
        base = graph_us([functools.partial(plain, x, w, res, nw) for w in weights])
        r = {"shape": name, "n": n, "k": k, "rows": m, "plain_us": base, "split_us": {}, "max_err": {}}
        for s in splits:
            if k % s:
                continue
            o, rr = split(x, weights[0], res, nw, s)
            r["max_err"][s] = max((o.float() - ref_out.float()).abs().max().item(),
                                  (rr.float() - ref_res.float()).abs().max().item())
            r["split_us"][s] = graph_us([functools.partial(split, x, w, res, nw, s) for w in weights])
        best = min(r["split_us"], key=r["split_us"].get)
        r["best_split"], r["best_us"] = best, r["split_us"][best]
        r["gain"] = 1.0 - r["best_us"] / base
        out.append(r)
        print(f"{name:5s} {n}x{k} rows {m:5d}: plain {base:7.2f} us; "
              + " ".join(f"split {s} {u:7.2f}" for s, u in r["split_us"].items())
              + f"  -> best {best} {100 * r['gain']:+.1f}%  (max |diff| {r['max_err'][best]:.2g})", flush=True)
    del weights
    torch.cuda.empty_cache()
    return out


def ranges(results: list[dict], margin: float) -> dict[str, list[list[int]]]:
    """Per (N, K): [first row, last row, parts] for each run of consecutive measured row counts whose best split
    beat the plain product by more than `margin` with the same part count."""
    table: dict[str, list[list[int]]] = {}
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        by_shape.setdefault((r["n"], r["k"]), []).append(r)
    for (n, k), rs in by_shape.items():
        rs.sort(key=lambda r: r["rows"])
        runs: list[list[int]] = []
        prev_won = False
        for r in rs:
            won = r["gain"] > margin
            s = r["best_split"] if won else 1
            if won and prev_won and runs[-1][2] == s:
                runs[-1][1] = r["rows"]
            elif won:
                runs.append([r["rows"], r["rows"], s])
            prev_won = won
        table[f"{n},{k}"] = runs
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--splits", default="2,3,4")
    ap.add_argument("--margin", type=float, default=0.03, help="the least gain (fraction) that puts a row count in")
    ap.add_argument("--min-bytes", type=int, default=768 << 20, help="weight copies per shape: at least this much")
    ap.add_argument("--layers", type=int, default=36, help="layers a step runs each pair in (the per-step sums)")
    ap.add_argument("--out", default="split_k.json")
    ap.add_argument("--table-out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    splits = [int(s) for s in args.splits.split(",") if 1 < int(s) <= MAX_PARTS]
    rows = [int(r) for r in args.rows.split(",")]
    ceil = {"hbm_copy_gbps": hbm_copy_gbps(), "bf16_matmul_tflops": matmul_tflops(),
            "gpu": torch.cuda.get_device_name()}
    print(f"ceilings: {ceil}", flush=True)
    results = []
    seen = set()
    for model in args.models.split(","):
        for name, n, k in PRESETS[model]:
            if (n, k) not in seen:
                seen.add((n, k))
                results += bench_shape(name, n, k, rows, splits, args.min_bytes)
    table = ranges(results, args.margin)
    for m in (128, 192, 256, 384):
        pairs = [r for r in results if r["rows"] == m and r["n"] == 4096]
        if pairs:
            before = sum(r["plain_us"] for r in pairs) * args.layers
            after = sum(min(r["plain_us"], r["best_us"]) if r["gain"] > args.margin else r["plain_us"]
                        for r in pairs) * args.layers
            print(f"qwen3-8b rows {m}: o+down with their norms {before / 1e3:.3f} -> {after / 1e3:.3f} ms a step "
                  f"({args.layers} layers)", flush=True)
    print("table: " + json.dumps(table), flush=True)
    rec = new_record("split_k", vars(args))
    rec.update(ceilings=ceil, results=results, table=table)
    save_json(rec, args.out)
    if args.table_out:
        doc = {"_source": f"benchmarks/engine/bench_split_k.py on an {ceil['gpu']} (margin {args.margin}): "
                          "per (N,K), [first row, last row, parts] where the split product plus its add+RMSNorm "
                          "beat the plain product plus the norm"}
        doc.update(table)
        with open(args.table_out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Would the other products of a decode step gain from a split over K? Times, GEMM alone (no consumer), the plain
product (pdserve.ops.linear.linear: cuBLAS above 16 rows) against the same product as float32 parts
(pdserve.ops.split_k.split_linear) at decode row counts, for qkv, o, gate_up and down of dummy Qwen3-8B; and, for
reference, each plain product's rate against the matmul ceiling measured in the same run.

Each timing replays a CUDA graph over distinct copies of the weight (together larger than L2), so each product
reads its weight from HBM, as in a step.

    python benchmarks/engine/probe_gemm_split.py --out $OUT/gemm_split.json
"""

from __future__ import annotations

import argparse
import functools

import torch

from pdserve.bench.ceilings import graph_us, matmul_tflops
from pdserve.bench.record import new_record, save_json
from pdserve.ops.linear import linear
from pdserve.ops.split_k import split_linear

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="128,192,224,256,288,320,384,512")
    ap.add_argument("--splits", default="2,3,4")
    ap.add_argument("--min-bytes", type=int, default=768 << 20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    dev = torch.device("cuda")
    tflops = matmul_tflops(dev)
    rec = new_record("gemm_split_probe", vars(args))
    rec["ceilings"] = {"bf16_matmul_tflops": tflops, "gpu": torch.cuda.get_device_name(dev)}
    rec["rows"] = []
    print(f"{torch.cuda.get_device_name(dev)}: matmul {tflops:.0f} TFLOP/s", flush=True)
    for name, n, k in SHAPES:
        copies = max(2, -(-args.min_bytes // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = graph_us([functools.partial(linear, x, w) for w in ws])
            r = {"shape": name, "n": n, "k": k, "rows": m, "plain_us": base,
                 "plain_tflops": 2 * m * n * k / base / 1e6, "split_us": {}}
            for s in splits:
                if k % s == 0:
                    r["split_us"][s] = graph_us([functools.partial(split_linear, x, w, s) for w in ws])
            rec["rows"].append(r)
            print(f"{name:8s} {n}x{k} rows {m:4d}: plain {base:7.2f} us ({r['plain_tflops']:4.0f} TFLOP/s, "
                  f"{100 * r['plain_tflops'] / tflops:3.0f} %); "
                  + " ".join(f"split {s} {u:7.2f}" for s, u in r["split_us"].items()), flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Linear products of a decode step at many rows (a batch-256 decode step, a mixed step of 256 decodes and a chunk):
cuBLAS (torch.mm) on a model's projection shapes, against the matmul and HBM rates measured in the same run.

Each timing replays a CUDA graph of calls over distinct copies of the weight (together larger than L2, as the
layers of a step are), so every call reads its weight from HBM and pays the gaps of a graph, as in a step. Per
shape and row count: microseconds, TFLOP/s, the fraction of the square-matmul rate, and the time the two floors give
(FLOPs at the matmul rate, the weight at the HBM copy rate): which of them binds, and how far the product is from it.

    python benchmarks/engine/bench_gemm_rows.py --model qwen3-8b --rows 64,128,256,512,768,1024 --out gemm_rows.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json

PRESETS = {
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
                 ("lm_head", 151936, 4096)],
    "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("lm_head", 151936, 2048)],
}


def bench(name: str, n: int, k: int, rows: list[int], ceil: dict, min_bytes: int, layers: int) -> list[dict]:
    nbytes = n * k * 2
    copies = max(2, -(-min_bytes // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = torch.empty(max(rows), n, device="cuda", dtype=torch.bfloat16)
    res = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        us = graph_us([functools.partial(torch.mm, x, w.t(), out=out[:m]) for w in weights])
        flops = 2.0 * m * n * k
        compute_us = flops / (ceil["bf16_matmul_tflops"] * 1e12) * 1e6
        memory_us = (nbytes + 2 * m * (n + k)) / (ceil["hbm_copy_gbps"] * 1e9) * 1e6
        floor = max(compute_us, memory_us)
        r = {"shape": name, "n": n, "k": k, "rows": m, "us": us, "tflops": flops / (us * 1e-6) / 1e12,
             "compute_floor_us": compute_us, "memory_floor_us": memory_us,
             "bound": "compute" if compute_us >= memory_us else "memory", "of_floor": floor / us,
             "us_per_step": us * (1 if name == "lm_head" else layers)}
        res.append(r)
        print(f"{name:8s} {n:6d}x{k:<6d} rows {m:5d}: {us:8.2f} us  {r['tflops']:6.1f} TFLOP/s  "
              f"floor {floor:7.2f} us ({r['bound']}) -> {r['of_floor']:.0%}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="64,128,256,512,768,1024")
    ap.add_argument("--layers", type=int, default=36, help="layers a step runs each projection in (us_per_step)")
    ap.add_argument("--min-bytes", type=int, default=768 << 20, help="weight copies per shape: at least this much")
    ap.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                    help="torch.backends.cuda.preferred_blas_library for the products (default: torch's)")
    ap.add_argument("--out", default="gemm_rows.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    print(f"BLAS library: {torch.backends.cuda.preferred_blas_library()}", flush=True)
    ceil = {"hbm_copy_gbps": hbm_copy_gbps(), "bf16_matmul_tflops": matmul_tflops()}
    print(f"ceilings: HBM copy {ceil['hbm_copy_gbps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, n, k in PRESETS[args.model]:
        results += bench(name, n, k, rows, ceil, args.min_bytes, args.layers)
    for m in rows:
        step = sum(r["us_per_step"] for r in results if r["rows"] == m)
        print(f"rows {m}: the step's products {step / 1e3:.2f} ms", flush=True)
    rec = new_record("gemm_rows", vars(args))
    rec.update(ceilings=ceil, results=results)
    save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

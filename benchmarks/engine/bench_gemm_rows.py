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


def split_k_mm(x: torch.Tensor, w: torch.Tensor, parts: torch.Tensor, out: torch.Tensor | None) -> None:
    """x [M, K] @ w [N, K]^T as `s` products over K's s slices in one strided-batched GEMM (views of x and w, no
    copies: s x the output tiles of one product, to fill SMs that one product's tiles leave idle), into parts
    [s, M, N]; summed into out unless out is None (the sum left to a later kernel)."""
    s, m, n = parts.shape
    k = x.shape[1]
    ks = k // s
    xs, ws = x.as_strided((s, m, ks), (ks, x.stride(0), 1)), w.as_strided((s, ks, n), (ks, 1, w.stride(0)))
    if parts.dtype != x.dtype:  # float32 parts of 16-bit inputs: cuBLAS writes its accumulators unrounded
        torch.bmm(xs, ws, out_dtype=parts.dtype, out=parts)
    else:
        torch.bmm(xs, ws, out=parts)
    if out is not None:
        if parts.dtype == out.dtype:
            torch.sum(parts, 0, out=out)
        else:
            out.copy_(parts.sum(0))


def bench(name: str, n: int, k: int, rows: list[int], ceil: dict, min_bytes: int, layers: int,
          split_k: tuple[int, ...] = (1,), parts_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    nbytes = n * k * 2
    copies = max(2, -(-min_bytes // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = torch.empty(max(rows), n, device="cuda", dtype=torch.bfloat16)
    res = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        us = graph_us([functools.partial(torch.mm, x, w.t(), out=out[:m]) for w in weights])
        ref = torch.mm(x, weights[0].t())
        for s in split_k:
            if s == 1 or k % s:
                continue
            parts = torch.empty(s, m, n, device="cuda", dtype=parts_dtype)
            split_k_mm(x, weights[0], parts, out[:m])
            err = ((out[:m].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us_s = graph_us([functools.partial(split_k_mm, x, w, parts, out[:m]) for w in weights])
            us_b = graph_us([functools.partial(split_k_mm, x, w, parts, None) for w in weights])
            res.append({"shape": name, "n": n, "k": k, "rows": m, "split_k": s, "us": us_s, "us_bmm_only": us_b,
                        "us_mm": us, "max_rel_err": err, "parts_dtype": str(parts_dtype), "variant": True})
            print(f"{name:8s} {n:6d}x{k:<6d} rows {m:5d}: split-K {s}: {us_s:8.2f} us with the sum, {us_b:8.2f} "
                  f"without (mm {us:8.2f} us; max error {err:.1e} of max |y|)", flush=True)
            del parts
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
    ap.add_argument("--split-k", default="1",
                    help="also time each product as this many K slices in one batched GEMM plus their sum "
                         "(comma-separated; 1: the plain product only)")
    ap.add_argument("--parts-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="the split products' partial sums: rounded to bf16, or cuBLAS's float32 accumulators")
    ap.add_argument("--shapes", default=None, help="only these projections of the preset (comma-separated names)")
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
    parts_dtype = torch.float32 if args.parts_dtype == "fp32" else torch.bfloat16
    for name, n, k in PRESETS[args.model]:
        if args.shapes and name not in args.shapes.split(","):
            continue
        results += bench(name, n, k, rows, ceil, args.min_bytes, args.layers,
                         tuple(int(s) for s in args.split_k.split(",")), parts_dtype)
    for m in rows:
        step = sum(r["us_per_step"] for r in results if r["rows"] == m and not r.get("variant"))
        print(f"rows {m}: the step's products {step / 1e3:.2f} ms", flush=True)
    rec = new_record("gemm_rows", vars(args))
    rec.update(ceilings=ceil, results=results)
    save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

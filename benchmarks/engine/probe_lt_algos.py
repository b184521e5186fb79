"""cuBLASLt's candidate algorithms for a decode step's products, each timed, against torch's pick (issue 10).

torch.mm asks cuBLAS(Lt) for its first heuristic answer and runs it. At a few hundred rows (a batch-256 decode
step) the products of an 8B model are not large enough for that first answer to fill the card: session 17 measured
o_proj at 256 rows at ~60 % of its floor, q/k/v at ~77 %. cuBLASLt returns up to `--algos` candidates for a shape
(tiles, split-K, stages, cluster shapes); this script times every one of them in a CUDA graph over weight copies
larger than L2 (as the layers of a step are), checks each result against torch.mm, and prints the best against
torch's own product measured the same way in the same run.

    python benchmarks/engine/probe_lt_algos.py --rows 128,256,512 --out $OUT/lt_algos.json

The binding is plain ctypes over the libcublasLt that torch already loaded (no build, no new package).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from pathlib import Path

import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm_rows import PRESETS  # noqa: E402  (the projections' shapes, one table for both scripts)

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
OP_N, OP_T = 0, 1
# cublasLtMatmulAlgoConfigAttributes_t, read only to label the candidates
CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                "inner": 7, "cluster": 8}


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _load() -> ctypes.CDLL:
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcublasLt.so" in ln})
    for p in paths + ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    raise OSError("libcublasLt not found")


class Lt:
    """A cuBLASLt handle and y[M, N] = x[M, K] @ w[N, K]^T in bf16 with float32 accumulation."""

    def __init__(self, workspace_bytes: int = 32 << 20):
        self.lib = _load()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 13 + [ctypes.c_void_p, ctypes.c_size_t,
                                                                      ctypes.c_void_p]
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.lib.cublasLtMatrixLayoutCreate.argtypes = [vp, i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
        self.lib.cublasLtMatmulDescCreate.argtypes = [vp, i32, i32]
        self.lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
        self.lib.cublasLtMatmulPreferenceCreate.argtypes = [vp]
        self.lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
        self.lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp] * 7 + [i32, vp, vp]
        self.lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [vp, i32, vp, sz, vp]

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cublasLt {what}: status {status}")

    def plan(self, m: int, n: int, k: int, count: int) -> tuple[tuple, list[HeuristicResult]]:
        lib = self.lib
        desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        ta, tb = ctypes.c_int32(OP_T), ctypes.c_int32(OP_N)
        self._check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(ta), 4), "transa")
        self._check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSB, ctypes.byref(tb), 4), "transb")
        # column-major: D[N, M] = op(A = w as K x N, transposed) @ (B = x as K x M)
        a, b, d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(a), CUDA_R_16BF, k, n, k), "layout a")
        self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(b), CUDA_R_16BF, k, m, k), "layout b")
        self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(d), CUDA_R_16BF, n, m, n), "layout d")
        pref = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(self.workspace.numel())
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                    "pref workspace")
        results = (HeuristicResult * count)()
        got = ctypes.c_int(0)
        self._check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, count, results,
                                                       ctypes.byref(got)), "heuristic")
        return (desc, a, b, d), [results[i] for i in range(got.value) if results[i].state == 0]

    def config(self, algo: HeuristicResult) -> dict:
        out = {}
        get = self.lib.cublasLtMatmulAlgoConfigGetAttribute
        for name, attr in CONFIG_ATTRS.items():
            size, v = ctypes.c_size_t(0), ctypes.c_uint64(0)
            if get(ctypes.byref(algo.algo), attr, None, 0, ctypes.byref(size)) != 0 or not 0 < size.value <= 8:
                continue
            if get(ctypes.byref(algo.algo), attr, ctypes.byref(v), size.value, ctypes.byref(size)) == 0:
                out[name] = int(v.value)
        return out

    def mm(self, descs: tuple, algo: HeuristicResult, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        desc, a, b, d = descs
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), d,
            ctypes.c_void_p(out.data_ptr()), d, ctypes.byref(algo.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(min(algo.workspace_size, self.workspace.numel())), ctypes.c_void_p(stream)), "matmul")


def bench(lt: Lt, name: str, n: int, k: int, rows: list[int], ceil: dict, min_bytes: int, count: int) -> list[dict]:
    nbytes = n * k * 2
    copies = max(2, -(-min_bytes // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = torch.empty(max(rows), n, device="cuda", dtype=torch.bfloat16)
    res = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        o = out[:m]
        torch_us = graph_us([functools.partial(torch.mm, x, w.t(), out=o) for w in weights])
        ref = torch.mm(x, weights[0].t()).float()
        scale = ref.abs().max().item()
        descs, algos = lt.plan(m, n, k, count)
        cands = []
        for i, al in enumerate(algos):
            try:
                o.zero_()
                lt.mm(descs, al, x, weights[0], o)
                torch.cuda.synchronize()
                err = (o.float() - ref).abs().max().item() / scale
                us = graph_us([functools.partial(lt.mm, descs, al, x, w, o) for w in weights])
            except RuntimeError as e:
                cands.append({"index": i, "error": str(e)})
                continue
            cands.append({"index": i, "us": us, "max_rel_err": err, "workspace": al.workspace_size,
                          "waves": al.waves, **lt.config(al)})
        ok = [c for c in cands if "us" in c and c["max_rel_err"] < 2e-2]
        best = min(ok, key=lambda c: c["us"]) if ok else None
        flops = 2.0 * m * n * k
        floor = max(flops / (ceil["bf16_matmul_tflops"] * 1e12), (nbytes + 2 * m * (n + k)) /
                    (ceil["hbm_copy_gbps"] * 1e9)) * 1e6
        r = {"shape": name, "n": n, "k": k, "rows": m, "torch_us": torch_us, "floor_us": floor,
             "first_us": ok[0]["us"] if ok and ok[0]["index"] == 0 else None,
             "best": best, "candidates": cands}
        res.append(r)
        if best:
            print(f"{name:8s} rows {m:5d}: torch {torch_us:8.2f} us ({floor / torch_us:.0%} of floor), "
                  f"lt first {r['first_us'] or float('nan'):8.2f}, best #{best['index']} {best['us']:8.2f} us "
                  f"({floor / best['us']:.0%}; {torch_us / best['us']:.3f}x) of {len(ok)} "
                  f"[tile {best.get('tile')} splitk {best.get('splitk')} stages {best.get('stages')} "
                  f"cluster {best.get('cluster')} ws {best['workspace']}]", flush=True)
        else:
            print(f"{name:8s} rows {m:5d}: torch {torch_us:8.2f} us; no usable candidate ({len(cands)})", flush=True)
    del weights
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="128,192,256,320,384,512")
    ap.add_argument("--algos", type=int, default=32, help="heuristic candidates asked for per shape")
    ap.add_argument("--min-bytes", type=int, default=768 << 20)
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--out", default="lt_algos.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ceil = {"hbm_copy_gbps": hbm_copy_gbps(), "bf16_matmul_tflops": matmul_tflops()}
    print(f"ceilings: HBM copy {ceil['hbm_copy_gbps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_tflops']:.0f} "
          f"TFLOP/s", flush=True)
    lt = Lt()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, n, k in PRESETS[args.model]:
        if args.shapes and name not in args.shapes.split(","):
            continue
        results += bench(lt, name, n, k, rows, ceil, args.min_bytes, args.algos)
    for m in rows:
        rs = [r for r in results if r["rows"] == m and r["best"]]
        per = {r["shape"]: (1 if r["shape"] == "lm_head" else args.layers) for r in rs}
        t = sum(r["torch_us"] * per[r["shape"]] for r in rs)
        b = sum(min(r["best"]["us"], r["torch_us"]) * per[r["shape"]] for r in rs)
        print(f"rows {m}: the step's products {t / 1e3:.3f} ms with torch's pick, {b / 1e3:.3f} ms with the best "
              f"of each ({(t - b) / 1e3:.3f} ms less)", flush=True)
    rec = new_record("lt_algos", vars(args))
    rec.update(ceilings=ceil, results=results)
    save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

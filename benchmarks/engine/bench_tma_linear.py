"""Linear products at a batch-256 decode step's row count: cuBLAS (torch.mm) against a Triton GEMM that loads its
tiles with TMA (tensor descriptors) and runs Hopper's wgmma with software pipelining, over dummy Qwen3-8B's
projection shapes, each against its floor (FLOPs at the matmul rate, the weight at the HBM copy rate, both measured
in the same run).

Why: at 256 rows a decode step's products took 5.88 ms of a 16.8 ms step, 84 % of their FLOPs' time at the measured
matmul rate (lease_s32/s32a); o and qkv ran at 63 % and 74 %. A plain Triton tile GEMM (bench_tile_linear.py, pointer
loads) lost to cuBLAS by 1.23-1.53x at 256 rows (lease_s18); its docstring names TMA loads as what a competitive
kernel would need. This kernel has them, in two forms:

- rows-major tiles (`swap` off): a [block_r rows, block_w outputs] tile, x @ w^T;
- weight-major tiles (`swap` on, as cuBLAS's nvjet kernels at these shapes): the product runs as w @ x^T, so the
  wgmma's M side (64 a warpgroup) is the weight's output features and its N side the rows; the tile is transposed
  on its way out.

Either is launched one program a tile (tiles sharing a weight tile next to each other) or persistent (one program an
SM walking the tiles). Each timing replays a CUDA graph of calls over distinct copies of the weight (together larger
than L2, as the layers of a step are). The fastest tile of each shape is checked against torch.mm.

    python benchmarks/engine/bench_tma_linear.py --rows 256 --out tma.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm_rows import PRESETS  # noqa: E402  (the projections' shapes, one table for the GEMM scripts)

SHAPES = PRESETS["qwen3-8b"]


@dataclass(frozen=True)
class TmaConfig:
    block_r: int  # rows of x a tile
    block_w: int  # output features (rows of the weight) a tile
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool  # w @ x^T (the weight on the wgmma's M side)
    persistent: bool


@triton.jit
def _tile_of(t, num_r):
    """Tile t's (row tile, weight tile): the row tiles of one weight tile one after the other."""
    return t % num_r, t // num_r


@triton.jit
def _one_tile(x_desc, w_desc, y_desc, t, num_r, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
              BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
    pr, pw = _tile_of(t, num_r)
    off_r = pr * BLOCK_R
    off_w = pw * BLOCK_W
    if SWAP:
        acc = tl.zeros((BLOCK_W, BLOCK_R), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([off_r, k])
        w = w_desc.load([off_w, k])
        if SWAP:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
    if SWAP:
        y_desc.store([off_r, off_w], acc.T.to(y_desc.dtype))
    else:
        y_desc.store([off_r, off_w], acc.to(y_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _tma_kernel(x_desc, w_desc, y_desc, M, N, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_K: tl.constexpr, SWAP: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr):
    num_r = tl.cdiv(M, BLOCK_R)
    if PERSISTENT:
        num_tiles = num_r * tl.cdiv(N, BLOCK_W)
        for t in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            _one_tile(x_desc, w_desc, y_desc, t, num_r, K, BLOCK_R, BLOCK_W, BLOCK_K, SWAP)
    else:
        _one_tile(x_desc, w_desc, y_desc, tl.program_id(0), num_r, K, BLOCK_R, BLOCK_W, BLOCK_K, SWAP)


def tma_linear(x: torch.Tensor, w: torch.Tensor, cfg: TmaConfig, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w [N, K]^T on the TMA kernel."""
    m, k = x.shape
    n = w.shape[0]
    xd = TensorDescriptor.from_tensor(x, [cfg.block_r, cfg.block_k])
    wd = TensorDescriptor.from_tensor(w, [cfg.block_w, cfg.block_k])
    yd = TensorDescriptor.from_tensor(out, [cfg.block_r, cfg.block_w])
    tiles = triton.cdiv(m, cfg.block_r) * triton.cdiv(n, cfg.block_w)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(sms, tiles),) if cfg.persistent else (tiles,)
    _tma_kernel[grid](xd, wd, yd, m, n, k, BLOCK_R=cfg.block_r, BLOCK_W=cfg.block_w, BLOCK_K=cfg.block_k,
                      SWAP=cfg.swap, PERSISTENT=cfg.persistent, NUM_SMS=sms, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
    return out


def configs() -> list[TmaConfig]:
    out = []
    for swap, persistent in itertools.product((True, False), (False, True)):
        if swap:
            tiles = [(64, 128), (128, 128), (256, 128), (128, 256), (64, 256), (128, 64)]  # (rows, weight rows)
        else:
            tiles = [(64, 128), (128, 128), (128, 256), (64, 256)]
        for (br, bw), bk, stages in itertools.product(tiles, (64, 128), (3, 4, 5)):
            smem = stages * (br + bw) * bk * 2 + br * bw * 2
            if smem > 220 * 1024 or (bk == 128 and stages == 5):
                continue
            for warps in ((4, 8) if br * bw == 128 * 128 else (8,) if br * bw > 128 * 128 else (4,)):
                out.append(TmaConfig(br, bw, bk, warps, stages, swap, persistent))
    return out


def _compile(cfgs: list[dict], shapes: list[tuple[int, int]], rows: list[int]) -> int:
    """Worker: run each config once per shape so its binaries land in Triton's on-disk cache."""
    failed = 0
    for c in cfgs:
        cfg = TmaConfig(**c)
        for n, k in shapes:
            w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
            for m in rows:
                try:
                    tma_linear(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), w, cfg,
                               torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
                except Exception:
                    failed += 1
            del w
    torch.cuda.synchronize()
    return failed


def precompile(cands: list[TmaConfig], shapes: list[tuple[int, int]], rows: list[int], procs: int) -> None:
    import multiprocessing as mp

    chunks = [[asdict(c) for c in cands[i::procs]] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.starmap(_compile, [(ch, shapes, rows) for ch in chunks if ch]))
    print(f"precompiled {len(cands)} configs in {procs} processes ({failed} launches failed)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="256")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--layers", type=int, default=36, help="layers a step runs each projection in (lm_head: once)")
    ap.add_argument("--min-bytes", type=int, default=768 << 20, help="weight copies per shape: at least this much")
    ap.add_argument("--precompile-procs", type=int, default=12)
    ap.add_argument("--out", default="tma_linear.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tma_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    ceil = {"gpu": torch.cuda.get_device_name(), "hbm_copy_gbps": hbm_copy_gbps(),
            "bf16_matmul_tflops": matmul_tflops()}
    print(f"ceilings: {ceil}", flush=True)
    cands = configs()
    if args.precompile_procs > 1:
        precompile(cands, [(n, k) for _, n, k in shapes], rows, args.precompile_procs)
    torch.manual_seed(0)
    results, summary = [], []
    for name, n, k in shapes:
        nbytes = n * k * 2
        copies = max(2, -(-args.min_bytes // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            flops = 2.0 * m * n * k
            flop_us = flops / (ceil["bf16_matmul_tflops"] * 1e12) * 1e6
            byte_us = (nbytes + 2 * m * (n + k)) / (ceil["hbm_copy_gbps"] * 1e9) * 1e6
            case = {"shape": name, "n": n, "k": k, "rows": m, "flop_us": flop_us, "byte_us": byte_us}
            cub = graph_us([functools.partial(torch.mm, x, w.t(), out=out) for w in weights])
            results.append({**case, "impl": "cublas", "us": cub})
            best = None
            for cfg in cands:
                try:
                    us = graph_us([functools.partial(tma_linear, x, w, cfg, out) for w in weights])
                except Exception as e:  # does not compile or fit: recorded
                    results.append({**case, "impl": "tma", "config": asdict(cfg), "error": repr(e)[:160]})
                    continue
                results.append({**case, "impl": "tma", "config": asdict(cfg), "us": us})
                if best is None or us < best[0]:
                    best = (us, cfg)
            line = {**case, "cublas_us": cub, "cublas_of_flops": flop_us / cub}
            if best is not None:
                us, cfg = best
                ref = torch.mm(x, weights[0].t()).float()
                got = tma_linear(x, weights[0], cfg, out).float()
                err = float((got - ref).abs().max() / ref.abs().max())
                line.update(tma_us=us, tma_of_flops=flop_us / us, tma_config=asdict(cfg), tma_rel_err=err,
                            tma_over_cublas=us / cub)
                by_kind = {}
                for r in results:
                    if r.get("impl") == "tma" and "us" in r and r["shape"] == name and r["rows"] == m:
                        key = ("swap" if r["config"]["swap"] else "rows") + (
                            "+persistent" if r["config"]["persistent"] else "")
                        by_kind[key] = min(by_kind.get(key, 1e9), r["us"])
                line["best_by_kind"] = by_kind
                print(f"{name:8s} {n:6d}x{k:<6d} rows {m:4d}: FLOPs {flop_us:7.2f} us, bytes {byte_us:7.2f} us | "
                      f"cuBLAS {cub:7.2f} us ({flop_us / cub:.0%}) | TMA {us:7.2f} us ({flop_us / us:.0%}, "
                      f"{us / cub:.3f}x cuBLAS, err {err:.2g}) {cfg} | by kind "
                      + ", ".join(f"{a} {b:.2f}" for a, b in sorted(by_kind.items())), flush=True)
            summary.append(line)
        del weights
        torch.cuda.empty_cache()
    for m in rows:
        cub = sum(s["cublas_us"] * (1 if s["shape"] == "lm_head" else args.layers) for s in summary if s["rows"] == m)
        best = sum(min(s["cublas_us"], s.get("tma_us", 1e9)) * (1 if s["shape"] == "lm_head" else args.layers)
                   for s in summary if s["rows"] == m)
        print(f"rows {m}: a step's products {cub / 1e3:.3f} ms on cuBLAS, {best / 1e3:.3f} ms taking the faster of "
              f"each ({(cub - best) / 1e3:.3f} ms less)", flush=True)
    rec = new_record("tma_linear", vars(args))
    rec.update(ceilings=ceil, summary=summary, results=results)
    save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

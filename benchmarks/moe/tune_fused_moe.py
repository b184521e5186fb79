"""Tune the fused MoE's tiles for one expert shape on this GPU and write the config table pdserve looks up
(pdserve/ops/configs/fused_moe/E=..,N=..,K=..,dtype=..,device=...json; see pdserve/ops/fused_moe_config.py).

For each token bucket and each candidate BLOCK_M (near the mean rows per expert), the two grouped GEMMs are timed
separately over their tile spaces (they share only BLOCK_M, the row padding), with the L2 cache flushed before every
run (triton.testing.do_bench); the bucket keeps the BLOCK_M whose align + gate/up + down time is least. The chosen
config is checked against the torch reference before it is written, and its end-to-end time is recorded beside the
untuned default's. Runs merge into an existing table, so buckets can be tuned over several calls.

  python benchmarks/moe/tune_fused_moe.py                       # Qwen3-30B-A3B experts, bf16, quick space
  python benchmarks/moe/tune_fused_moe.py --tokens 1 2 4 8 16   # some buckets now, the rest in another call
  python benchmarks/moe/tune_fused_moe.py --space full          # a wider search (longer: ~4x the compiles)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from pdserve.bench.record import new_record, save_json
from pdserve.model.moe import softmax_topk
from pdserve.ops.fused_moe import down, fused_moe, fused_moe_ref, gate_up
from pdserve.ops.fused_moe_config import CONFIG_DIR, GemmTile, MoEKernelConfig, config_file_name, default_config
from pdserve.ops.moe_align import moe_align

BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
SMEM_LIMIT = 220 * 1024  # Hopper: 227 KiB of shared memory per block
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread beyond which the kernel spills


def block_m_candidates(num_tokens: int, top_k: int, experts: int) -> list[int]:
    r = num_tokens * top_k / experts
    if r < 4:
        return [16]
    if r < 12:
        return [16, 32]
    if r < 24:
        return [16, 32, 64]
    if r < 64:
        return [32, 64, 128]
    return [64, 128]


def tile_space(block_m: int, n_operands: int, elem: int, full: bool, multi_block: bool) -> list[GemmTile]:
    """GEMM tiles for one BLOCK_M; n_operands = B tiles per K step (2 for gate+up). GROUP_M only matters when an
    expert spans several row blocks."""
    if n_operands == 2:
        block_n = [32, 64, 128]
    else:
        block_n = [64, 128, 256] if full else [64, 128]
    block_k = [64, 128, 256] if full else [64, 128]
    warps = [4, 8]
    stages = [2, 3, 4, 5] if full else [3, 4]
    groups = ([1, 8, 32] if full else [1, 16]) if multi_block else [1]
    out = []
    for bn, bk, w, s, g in itertools.product(block_n, block_k, warps, stages, groups):
        smem = s * (block_m * bk + n_operands * bk * bn) * elem
        acc_regs = n_operands * block_m * bn // (32 * w) if n_operands == 2 else block_m * bn // (32 * w)
        if smem > SMEM_LIMIT or acc_regs > MAX_ACC_REGS or (w == 8 and block_m * bn < 64 * 64):
            continue
        out.append(GemmTile(bn, bk, g, w, s))
    return out


def bench_us(fn) -> float | None:
    """Median time of fn on the GPU, L2 flushed before each run; None when the tile does not compile or fit."""
    import triton

    try:
        if torch.cuda.is_available():
            return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3
        t = time.perf_counter()  # CPU (Triton's interpreter): smoke runs of this script only, times are meaningless
        fn()
        return (time.perf_counter() - t) * 1e6
    except Exception as e:  # a tile too large for this GPU (OutOfResources), or a failed compile
        print(f"    skipped: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return None


def tune_bucket(T: int, args, w13, w2, dtype) -> tuple[MoEKernelConfig, dict]:
    E, K = args.experts, args.top_k
    dev = w13.device
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, args.hidden, device=dev, dtype=dtype, generator=gen)
    weights, ids = softmax_topk(torch.randn(T, E, device=dev, generator=gen), K, True)
    elem = torch.empty((), dtype=dtype).element_size()
    best: tuple[float, MoEKernelConfig, dict] | None = None
    for bm in block_m_candidates(T, K, E):
        multi = T * K / E > bm
        align_us = bench_us(lambda bm=bm: moe_align(ids, E, bm))
        aligned = moe_align(ids, E, bm)
        gu = [(bench_us(lambda t=t, a=aligned: gate_up(x, w13, a, K, "silu", t)), t)
              for t in tile_space(bm, 2, elem, args.space == "full", multi)]
        gu_us, gu_tile = min(((u, t) for u, t in gu if u is not None), key=lambda p: p[0])
        act = gate_up(x, w13, aligned, K, "silu", gu_tile)
        dn = [(bench_us(lambda t=t, a=aligned, h=act: down(h, w2, weights, a, t)), t)
              for t in tile_space(bm, 1, elem, args.space == "full", multi)]
        dn_us, dn_tile = min(((u, t) for u, t in dn if u is not None), key=lambda p: p[0])
        total = align_us + gu_us + dn_us
        print(f"  T={T:5d} BLOCK_M={bm:3d}: align {align_us:7.1f} + gate_up {gu_us:7.1f} + down {dn_us:7.1f} = "
              f"{total:7.1f} us  ({len(gu)}+{len(dn)} tiles)", flush=True)
        if best is None or total < best[0]:
            best = (total, MoEKernelConfig(bm, gu_tile, dn_tile),
                    {"align_us": align_us, "gate_up_us": gu_us, "down_us": dn_us})
    _, cfg, parts = best
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, config=cfg)
    err = (out.float() - ref.float()).abs().max().item()
    if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
        raise RuntimeError(f"T={T}: the tuned config {cfg} disagrees with the reference (max error {err})")
    dflt = default_config(E, args.inter, args.hidden, dtype, T, K)
    timing = {**parts,
              "tuned_us": bench_us(lambda: fused_moe(x, w13, w2, weights, ids, config=cfg)),
              "default_us": bench_us(lambda: fused_moe(x, w13, w2, weights, ids, config=dflt)),
              "max_abs_err_vs_ref": err}
    return cfg, timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--inter", type=int, default=768, help="each expert's intermediate size (N)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (K)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=BUCKETS)
    ap.add_argument("--space", choices=["quick", "full"], default="quick")
    ap.add_argument("--out", help="table path (default: the one pdserve looks up for this GPU, in the source tree)")
    ap.add_argument("--max-minutes", type=float, default=9.0, help="stop starting new buckets after this long")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs Triton's interpreter (a smoke test, with --out)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if dev.type != "cuda" and not args.out:
        ap.error("--device cpu is a smoke run: give --out, the source tree's tables are for GPUs")
    out = Path(args.out) if args.out else CONFIG_DIR / config_file_name(args.experts, args.inter, args.hidden, dtype, gpu)
    key = {"E": args.experts, "N": args.inter, "K": args.hidden, "dtype": args.dtype, "device": gpu}
    table = {"key": key, "top_k": args.top_k, "configs": {}, "tuning": {}}
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("key") == key and old.get("top_k") == args.top_k:
            table["configs"], table["tuning"] = old.get("configs", {}), old.get("tuning", {})
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, device=dev, dtype=dtype, generator=gen)
    w13 *= args.hidden**-0.5
    w2 = torch.randn(args.experts, args.hidden, args.inter, device=dev, dtype=dtype, generator=gen)
    w2 *= args.inter**-0.5
    t0 = time.time()
    print(f"tuning E={args.experts} N={args.inter} K={args.hidden} top_k={args.top_k} {args.dtype} on {gpu} "
          f"-> {out}", flush=True)
    for T in args.tokens:
        if time.time() - t0 > args.max_minutes * 60:
            print(f"time budget reached; buckets left for another call: {[t for t in args.tokens if t >= T]}")
            break
        cfg, timing = tune_bucket(T, args, w13, w2, dtype)
        table["configs"][str(T)] = cfg.to_dict()
        table["tuning"][str(T)] = timing
        print(f"T={T:5d}: {cfg.to_dict()}  tuned {timing['tuned_us']:.1f} us, default {timing['default_us']:.1f} us",
              flush=True)
        table["configs"] = dict(sorted(table["configs"].items(), key=lambda kv: int(kv[0])))
        table["tuning"] = dict(sorted(table["tuning"].items(), key=lambda kv: int(kv[0])))
        table["record"] = {k: v for k, v in new_record("tune_fused_moe", vars(args)).items() if k != "runs"}
        save_json(table, out)  # after every bucket: an interrupted run keeps what it found
    print(f"wrote {out} ({len(table['configs'])} buckets) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

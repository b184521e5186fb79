"""A MoE layer's routing and row grouping at Qwen3-30B-A3B's 128 experts and top-8, one way against the other, in
CUDA graphs as decode steps run them:

- routing: softmax_topk (torch: softmax, top-k, sum, division, int32 copy) against route_topk (one Triton launch);
- grouping: moe_align's one-program path against its three kernels (with their two fills), up to
  ONE_PROGRAM_PAIRS routed rows, and the three kernels alone above it.

Each case is a graph of --reps calls replayed --iters times; us a call is the median replay over reps. Both paths'
outputs are checked against each other before timing.

  python benchmarks/moe/bench_route.py --out $OUT/route.json
"""

from __future__ import annotations

import argparse

import torch

from pdserve.bench import ceilings
from pdserve.bench.record import new_record, save_json
from pdserve.model.moe import softmax_topk
from pdserve.ops import moe_align as ma
from pdserve.ops.moe_route import route_topk

TOKENS = [1, 4, 16, 64, 128, 256, 512, 1024, 8192]


def graph_us(fn, reps: int, iters: int) -> float:
    """Median us a call over `iters` replays of a CUDA graph holding `reps` calls of fn."""
    return ceilings.graph_us([fn] * reps, reps=iters)


def align_with(ids: torch.Tensor, E: int, block_m: int, one_program: bool) -> ma.AlignedRows:
    saved = ma.ONE_PROGRAM_PAIRS
    ma.ONE_PROGRAM_PAIRS = saved if one_program else -1
    try:
        return ma.moe_align(ids, E, block_m)
    finally:
        ma.ONE_PROGRAM_PAIRS = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--reps", type=int, default=48, help="calls in a graph (48: a Qwen3-30B-A3B step's MoE layers)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="route.json")
    args = ap.parse_args()
    E, K = args.experts, args.top_k
    rec = new_record("moe_route", vars(args))
    rows = []
    for T in TOKENS:
        logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
        w_t, ids_t = softmax_topk(logits, K, True)
        w_k, ids_k = route_topk(logits, K, True)
        same_ids = bool((ids_t == ids_k).all())
        max_w_err = float((w_t - w_k).abs().max())
        row = {"tokens": T, "pairs": T * K, "same_ids": same_ids, "max_weight_err": max_w_err,
               "route_torch_us": graph_us(lambda x=logits: softmax_topk(x, K, True), args.reps, args.iters),
               "route_triton_us": graph_us(lambda x=logits: route_topk(x, K, True), args.reps, args.iters)}
        row["align_three_kernels_us"] = graph_us(lambda i=ids_k: align_with(i, E, args.block_m, False), args.reps,
                                                 args.iters)
        if T * K <= ma.ONE_PROGRAM_PAIRS:
            a1, a3 = align_with(ids_k, E, args.block_m, True), align_with(ids_k, E, args.block_m, False)
            row["align_same_blocks"] = bool(torch.equal(a1.expert_ids, a3.expert_ids)
                                            and torch.equal(a1.num_rows, a3.num_rows))
            row["align_one_program_us"] = graph_us(lambda i=ids_k: align_with(i, E, args.block_m, True), args.reps,
                                                   args.iters)
        rows.append(row)
        print(f"T={T:5d}: route torch {row['route_torch_us']:7.2f} us, triton {row['route_triton_us']:6.2f} us "
              f"(ids same {same_ids}, max weight err {max_w_err:.1e}); align three kernels "
              f"{row['align_three_kernels_us']:6.2f} us, one program "
              + (f"{row['align_one_program_us']:6.2f} us" if "align_one_program_us" in row else "-"), flush=True)
    rec["results"] = rows
    save_json(rec, args.out)


if __name__ == "__main__":
    main()

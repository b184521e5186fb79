"""The fused MoE at Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, expert width 768, bf16) for 1 to
4096 tokens, against its floor measured in the same run and against the torch reference.

floor = max(bytes / HBM rate, FLOPs / matmul rate), both rates measured here (pdserve.bench.ceilings):
  bytes = the touched experts' weights (3 * H * I each) + the tokens' hidden states in and out;
  FLOPs = 2 * T * K * 3 * H * I.
Each timing cycles through --layers copies of the expert weights (a model's consecutive layers), so weights come
from HBM rather than from L2, and replays a CUDA graph of those calls as decode steps do (eager times too).
Correctness against the reference is recorded for every token count.

  python benchmarks/moe/bench_fused_moe.py --out $OUT/fused_moe_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from pdserve.bench.ceilings import hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json
from pdserve.model.moe import softmax_topk
from pdserve.ops.fused_moe import fused_moe, fused_moe_ref
from pdserve.ops.fused_moe_config import default_config, get_config

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def _time_us(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _graph(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=4, help="weight copies cycled through per timed call (L2-cold)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--ref-max-tokens", type=int, default=4096, help="time the torch reference up to this count")
    ap.add_argument("--defaults", action="store_true", help="use the untuned default configs, not a tuned table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    E, K, H, inter, L = args.experts, args.top_k, args.hidden, args.inter, args.layers
    elem = torch.empty((), dtype=dtype).element_size()

    hbm = hbm_copy_gbps(dev)
    mm = matmul_tflops(dev, dtype=dtype)
    rec = new_record("fused_moe", vars(args))
    rec["ceilings"] = {"gpu": torch.cuda.get_device_name(dev), "hbm_copy_gbps": hbm, f"{args.dtype}_matmul_tflops": mm}
    print(f"{rec['ceilings']['gpu']}: HBM copy {hbm:.0f} GB/s, {args.dtype} matmul {mm:.0f} TFLOP/s", flush=True)

    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = [torch.randn(E, 2 * inter, H, device=dev, dtype=dtype, generator=gen) * H**-0.5 for _ in range(L)]
    w2 = [torch.randn(E, H, inter, device=dev, dtype=dtype, generator=gen) * inter**-0.5 for _ in range(L)]
    expert_bytes = 3 * H * inter * elem
    rows = []
    print(f"{'tokens':>6} {'experts':>7} {'floor us':>9} {'bound':>5} {'graph us':>9} {'eager us':>9} {'of floor':>8} "
          f"{'ref us':>9} {'vs ref':>7} {'max err':>8}", flush=True)
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=dtype, generator=gen)
        routes = [softmax_topk(torch.randn(T, E, device=dev, generator=gen), K, True) for _ in range(L)]
        cfg = default_config(E, inter, H, dtype, T, K) if args.defaults else get_config(E, inter, H, dtype, T, K, dev)

        def run(cfg=cfg, x=x, routes=routes):
            for i in range(L):
                fused_moe(x, w13[i], w2[i], routes[i][0], routes[i][1], config=cfg)

        touched = statistics.mean(int(torch.unique(ids).numel()) for _, ids in routes)
        bytes_ = touched * expert_bytes + 2 * T * H * elem
        flops = 2 * T * K * 3 * H * inter
        t_bytes, t_flops = bytes_ / (hbm * 1e9) * 1e6, flops / (mm * 1e12) * 1e6
        floor_us = max(t_bytes, t_flops)
        graph = _graph(run)
        graph_us = _time_us(graph.replay, args.iters) / L
        eager_us = _time_us(run, args.iters) / L
        w, ids = routes[0]
        ref = fused_moe_ref(x, w13[0], w2[0], w, ids)
        err = (fused_moe(x, w13[0], w2[0], w, ids, config=cfg).float() - ref.float()).abs().max().item()
        ref_us = None
        if T <= args.ref_max_tokens:
            ref_us = _time_us(lambda x=x, routes=routes: [fused_moe_ref(x, w13[i], w2[i], *routes[i]) for i in range(L)],
                              max(3, args.iters // 5)) / L
        row = {"tokens": T, "touched_experts": touched, "bytes": bytes_, "flops": flops, "floor_us": floor_us,
               "floor_bound": "hbm" if t_bytes >= t_flops else "flops", "fused_graph_us": graph_us,
               "fused_eager_us": eager_us, "fraction_of_floor": floor_us / graph_us, "ref_us": ref_us,
               "speedup_vs_ref": (ref_us / graph_us) if ref_us else None, "max_abs_err_vs_ref": err,
               "config": cfg.to_dict()}
        rows.append(row)
        ref_s = f"{ref_us:9.1f} {ref_us / graph_us:6.1f}x" if ref_us else f"{'-':>9} {'-':>7}"
        print(f"{T:6d} {touched:7.1f} {floor_us:9.1f} {row['floor_bound']:>5} {graph_us:9.1f} {eager_us:9.1f} "
              f"{row['fraction_of_floor']:8.2f} {ref_s} {err:8.4f}", flush=True)
        del graph
    rec["results"] = rows
    print(f"wrote {save_json(rec, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

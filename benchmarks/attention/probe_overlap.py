"""Can a product hide under the batch-256 decode attention? (issue 10's batch-256 criterion)

At 256 rows dummy Qwen3-8B's products are compute-bound and the decode attention is bound by its KV read, so a step
whose kernels run one after another cannot reach its floor (weights + KV at the HBM rate). This probe measures
whether the two overlap on one H200 when launched on two streams: per layer (12 layers cycled, each with its own
KV and weights so nothing stays in L2), the decode kernel alone, a product alone (the o projection 4096x4096, or
gate_up 24576x4096, at 256 rows), both one after the other, and both at once (the product on a second stream,
forked and joined each layer; with and without a high-priority stream; eager, and captured in one CUDA graph).
Session 41 (benchmarks/lease_s41/s41d, an H200): in a graph 7-26 % of the o product's time hid under the attention
and none of gate_up's: with these kernels (the attention's programs fill every SM), two streams do not take a
step toward the batch-256 floor.

    python benchmarks/attention/probe_overlap.py --out overlap.json
"""
from __future__ import annotations

import argparse
import functools

import torch
from probe_kv_read import add_step_args, step_pool

from pdserve.bench.ceilings import _time_ms, graph_us, hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention.decode import paged_decode


def eager_us(calls, reps: int = 20) -> float:
    """Median microseconds per call of `calls` launched eagerly back to back on the current stream (the ceilings'
    CUDA-event timer over the whole list)."""
    return _time_ms(lambda: [c() for c in calls], warmup=1, iters=reps) * 1e3 / len(calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    hbm = hbm_copy_gbps(dev)
    mm = matmul_tflops(dev)
    rec = new_record("overlap_probe", vars(args))
    rec["ceilings"] = {"hbm_copy_gbps": hbm, "matmul_tflops": mm, "gpu": torch.cuda.get_device_name(dev)}
    rec["rows"] = []
    b, ctx, d = args.batch, args.context, args.head_dim
    pool, layers, bt, kv_bytes = step_pool(args, dev)
    q = torch.randn((b, args.hq, d), dtype=torch.bfloat16, device=dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    h = args.hidden
    x = torch.randn((b, h), dtype=torch.bfloat16, device=dev)
    prods = {"o": h, "gate_up": 6 * h}
    weights = {k: [torch.randn((n, h), dtype=torch.bfloat16, device=dev) * 0.02 for _ in layers]
               for k, n in prods.items()}
    side = torch.cuda.Stream()
    side_hi = torch.cuda.Stream(priority=-1)
    print(f"{torch.cuda.get_device_name(dev)}: HBM copy {hbm:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s; "
          f"{b} rows x {ctx} keys, {len(layers)} layers cycled", flush=True)

    def attn(i):
        paged_decode(q, layers[i], bt, sl, ctx, d ** -0.5)

    def prod(k, i):
        torch.nn.functional.linear(x, weights[k][i])

    def serial(k, i):
        attn(i)
        prod(k, i)

    def forked(k, stream, prod_first, i):
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        if prod_first:
            with torch.cuda.stream(stream):
                prod(k, i)
            attn(i)
        else:
            attn(i)  # launched first: its programs take the SMs, the product's fill in as they retire
            with torch.cuda.stream(stream):
                prod(k, i)
        main.wait_stream(stream)

    n = len(layers)

    def report(name, us, **kw):
        rec["rows"].append({"arm": name, "us": us, **kw})
        print(f"{name:34s} {' '.join(f'{a}={v}' for a, v in kw.items()):28s} {us:8.1f} us a layer", flush=True)

    for how, timer in (("graph", graph_us), ("eager", eager_us)):
        a_us = timer([functools.partial(attn, i) for i in range(n)])
        report("attention", a_us, how=how)
        for k in prods:
            p_us = timer([functools.partial(prod, k, i) for i in range(n)])
            report(f"{k}", p_us, how=how)
            s_us = timer([functools.partial(serial, k, i) for i in range(n)])
            report(f"attention then {k}", s_us, how=how)
            for sname, st in (("side", side), ("side_hi", side_hi)):
                for pf in (False, True):
                    o_us = timer([functools.partial(forked, k, st, pf, i) for i in range(n)])
                    report(f"attention || {k}", o_us, how=how, stream=sname, first="prod" if pf else "attn")
                    rec["rows"][-1]["hidden_of_product"] = (s_us - o_us) / p_us
    if args.out:
        save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

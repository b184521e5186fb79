"""A whole serving run's serial bound: how fast a run of N prompts (input_len in, output_len out, at most C at once)
could finish on the GPU whose ceilings a bench_steps.py record measured, if its attention and its products never
overlap (issue 10). Every engine we compare (pdserve, vLLM 0.22) runs a layer's attention and products one after
the other, so a client's measured duration over this bound says how much of the GPU's time such an engine leaves
on the table, and what a throughput target over another engine's measured run would demand.

The run's work does not depend on how steps are formed:
  KV bytes read      every decode token reads its whole context; every prompt token its prompt so far (bench_steps
                     .floors' count, step by step)
  attention FLOPs    query-key pairs of the prompts (causal) and of every decode token
  product FLOPs      every computed token through the layers' matrices, plus the LM head for every sampled token
  weight reads       each step reads the weights once; a run has at least N * (output_len - 1) / C decode steps
                     (no step holds more than C decoding requests); a mixture of experts' step reads the experts its
                     tokens route to (bench_steps.floors: at C rows, uniform routing assumed), and each token
                     multiplies top_k of them
and the bound is the attention's larger part plus the products' larger part:
  serial bound = max(KV bytes / HBM copy rate, attention FLOPs / matmul rate)
               + max(fewest steps * weight bytes / HBM copy rate, product FLOPs / matmul rate)
Each max is of sums, not a sum of per-step maxima, so it holds for any grouping of prompts and decodes into steps.
What it leaves out (norms, activation, rotary, sampling, launch gaps, the client's own latency) only adds time.

  python benchmarks/engine/run_bound.py --steps s34b/steps.json --input-len 1024 --output-len 1024 \\
      --num-prompts 512 --concurrency 256 --result vllm=vllm_single_1024x1024_c256.json \\
      --result pdserve=pdserve_single_1024x1024_c256.json --target 1.15 --over vllm
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import floors  # noqa: E402  (this folder's script, not a package)

PREFILL_BUDGET = 8192  # tokens of whole prompts counted a step (the engines' default step budget); the bound does
# not depend on it: every sum below is over tokens, only the per-step rounding of the count is


def run_work(sizes: dict, input_len: int, output_len: int, num_prompts: int, concurrency: int) -> dict:
    """The run's KV bytes read, attention and product FLOPs, and fewest decode steps (see the module docstring)."""
    if min(input_len, output_len, num_prompts, concurrency) < 1:
        raise ValueError("input_len, output_len, num_prompts and concurrency must be positive")
    unit = {"hbm_copy_gbps": 1.0, "bf16_matmul_tflops": 1.0}  # floors' times are not used here, only its counts
    kv = attn = prod = 0.0
    per_step = max(1, PREFILL_BUDGET // input_len)
    for first in range(0, num_prompts, per_step):  # every prompt, whole, sampling its first token
        k = min(per_step, num_prompts - first)
        f = floors(sizes, unit, [(0, input_len)] * k, k)
        kv, attn, prod = kv + f["kv_bytes_read"], attn + f["attn_flops"], prod + f["prod_flops"]
    for t in range(1, output_len):  # decode token t of every request: input_len + t - 1 tokens cached, one new
        f = floors(sizes, unit, [(input_len + t - 1, 1)], 1)
        kv += num_prompts * f["kv_bytes_read"]
        attn += num_prompts * f["attn_flops"]
        prod += num_prompts * f["prod_flops"]
    steps = math.ceil(num_prompts * (output_len - 1) / concurrency)
    full = floors(sizes, unit, [(input_len, 1)] * min(concurrency, num_prompts), 0)  # a step's weights at the most rows
    return {"kv_bytes_read": kv, "attn_flops": attn, "prod_flops": prod, "min_decode_steps": steps,
            "weight_bytes_read": steps * full["weight_bytes"]}


def run_bound(sizes: dict, ceil: dict, input_len: int, output_len: int, num_prompts: int, concurrency: int) -> dict:
    """The run's serial bound in seconds, its parts, and the output tokens/s it allows."""
    w = run_work(sizes, input_len, output_len, num_prompts, concurrency)
    hbm, mm = ceil["hbm_copy_gbps"] * 1e9, ceil["bf16_matmul_tflops"] * 1e12  # per second
    parts = {"kv_read_s": w["kv_bytes_read"] / hbm, "attn_flops_s": w["attn_flops"] / mm,
             "weights_read_s": w["weight_bytes_read"] / hbm, "prod_flops_s": w["prod_flops"] / mm}
    attention = max(parts["kv_read_s"], parts["attn_flops_s"])
    products = max(parts["weights_read_s"], parts["prod_flops_s"])
    bound = attention + products
    return {**w, **parts, "attention_s": attention, "products_s": products, "bound_s": bound,
            "output_tokens": num_prompts * output_len, "bound_output_tps": num_prompts * output_len / bound,
            "ceilings": {k: ceil[k] for k in ("gpu", "hbm_copy_gbps", "bf16_matmul_tflops") if k in ceil}}


def fraction(bound: dict, result: dict) -> float:
    """The share of the bound a client's run reached: bound seconds over the run's measured duration."""
    return bound["bound_s"] / result["duration"]


def needed(bound: dict, result: dict, target: float) -> float:
    """The share of the bound a run `target` times faster (in output tokens/s) than `result` would have to reach."""
    return bound["bound_s"] / (result["duration"] / target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", required=True, help="a bench_steps.py record (its engine sizes and ceilings)")
    ap.add_argument("--input-len", type=int, required=True)
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--num-prompts", type=int, required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--result", action="append", default=[], metavar="NAME=FILE",
                    help="a client's record of the same workload (vLLM's bench serve format: duration)")
    ap.add_argument("--target", type=float, help="a throughput ratio to check (e.g. 1.15) over --over's result")
    ap.add_argument("--over", help="the --result NAME the target is over")
    args = ap.parse_args(argv)
    rec = json.loads(Path(args.steps).read_text())
    b = run_bound(rec["engine"], rec["ceilings"], args.input_len, args.output_len, args.num_prompts,
                  args.concurrency)
    print(f"run bound: {b['bound_s']:.2f} s ({b['bound_output_tps']:.1f} output tok/s): attention "
          f"{b['attention_s']:.2f} s (KV read {b['kv_read_s']:.2f}, FLOPs {b['attn_flops_s']:.2f}) + products "
          f"{b['products_s']:.2f} s (weights over {b['min_decode_steps']} steps {b['weights_read_s']:.2f}, "
          f"FLOPs {b['prod_flops_s']:.2f}); ceilings {b['ceilings']}")
    results = {}
    for spec in args.result:
        name, _, path = spec.partition("=")
        results[name] = json.loads(Path(path).read_text())
        r = results[name]
        print(f"{name}: {r['duration']:.2f} s, {r['output_throughput']:.1f} output tok/s: "
              f"{fraction(b, r):.1%} of the bound")
    if args.target:
        if args.over not in results:
            ap.error("--target needs --over NAME of a --result")
        print(f"{args.target}x {args.over}'s output tok/s needs {needed(b, results[args.over], args.target):.1%} "
              f"of the bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

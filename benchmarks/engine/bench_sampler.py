"""The sampler of a decode step on Qwen3's vocabulary (151,936 tokens, bf16 logits): the torch path against the
sampling kernels (pdserve.ops.sampling: `_partials_kernel` reads the logits once, `_pick_kernel` draws by the inverse
CDF), for requests that leave out temperature (1.0, the OpenAI default, what vLLM's `bench serve` sends), that ask
for 0.7, and greedy ones; at 1, 64 and 256 rows.

Each time is triton.testing.do_bench's median over `sample_async` (host work plus kernels; the pinned copy of the
tokens included, the wait for them not), in microseconds; at the default temperature also the kernels alone
(`sample_tokens` replayed in a CUDA graph). --sweep: the kernels alone per launch shape (programs per SM and warps
of the first kernel, steps of 2048 columns a chunk at most, warps of the second).

    python benchmarks/engine/bench_sampler.py --out $OUT/sampler.json
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton.testing

from pdserve.bench.ceilings import graph_us
from pdserve.bench.record import new_record, save_json
from pdserve.engine import sampler as S
from pdserve.engine.request import Request
from pdserve.ops.sampling import MAX_CHUNK_STEPS, NUM_WARPS, TARGET_PROGRAMS_PER_SM, sample_tokens
from pdserve.sampling_params import SamplingParams

VOCAB = 151936
KINDS = {"default (T=1)": {}, "T=0.7": {"temperature": 0.7}, "greedy": {"temperature": 0.0}}


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels per launch shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    real = S.use_fused
    rec = new_record("sampler", vars(args))
    rec["results"] = []
    for n in (int(r) for r in args.rows.split(",")):
        logits = torch.randn((n, VOCAB), device=dev).to(torch.bfloat16)
        for kind, params in KINDS.items():
            reqs = [Request(f"r{i}", [1], SamplingParams(**params), frozenset()) for i in range(n)]
            row = {"rows": n, "kind": kind}
            for path, fused in (("torch", False), ("kernel", True)):
                S.use_fused = real if fused else (lambda x: False)
                try:
                    S.sample_async(logits, reqs).result()
                    row[f"{path}_us"] = us(lambda lg=logits, rq=reqs: S.sample_async(lg, rq))
                finally:
                    S.use_fused = real
            if kind == "default (T=1)":  # the kernels alone, in a CUDA graph (no host work)
                inv_t = torch.ones(n, device=dev)
                row["kernel_graph_us"] = graph_us([functools.partial(sample_tokens, logits, inv_t, i + 1)
                                                   for i in range(20)])
            rec["results"].append(row)
            print(f"rows {n:4d} {kind:14s}: torch {row['torch_us']:8.1f} us, kernel {row['kernel_us']:8.1f} us "
                  f"({row['torch_us'] / row['kernel_us']:.2f}x)"
                  + (f"; the kernels alone {row['kernel_graph_us']:.1f} us" if "kernel_graph_us" in row else ""),
                  flush=True)
    if args.sweep:  # the kernels alone at the default temperature per launch shape
        rec["sweep"] = []
        for n in (int(r) for r in args.rows.split(",")):
            logits = torch.randn((n, VOCAB), device=dev).to(torch.bfloat16)
            inv_t = torch.ones(n, device=dev)
            shapes = [{"programs_per_sm": per_sm, "num_warps": warps, "max_chunk_steps": steps}
                      for per_sm in (2, 4, 8, 16) for warps in (4, 8) for steps in (4, 8, 16)]
            shapes += [{"programs_per_sm": TARGET_PROGRAMS_PER_SM, "num_warps": NUM_WARPS,
                        "max_chunk_steps": MAX_CHUNK_STEPS, "pick_warps": w} for w in (1, 2, 4, 8)]
            for shape in shapes:
                t = graph_us([functools.partial(sample_tokens, logits, inv_t, i + 1, **shape) for i in range(20)])
                rec["sweep"].append({"rows": n, **shape, "us": t})
                print(f"sweep rows {n:4d} " + " ".join(f"{k} {v}" for k, v in shape.items()) + f": {t:8.1f} us",
                      flush=True)
    if args.out:
        save_json(rec, args.out)


if __name__ == "__main__":
    main()

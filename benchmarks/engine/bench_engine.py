"""Engine speed on one GPU with a realistic shape and random weights (default dummy qwen3-8b): prefill tokens/s
and decode step time at several batch sizes, each against a ceiling measured in the same run.

decode: (weight bytes + KV bytes read per step) / measured HBM copy bandwidth, over the measured step time.
prefill: (2 * params * tokens + attention FLOPs) / measured bf16 matmul rate, over the measured step time.

  python benchmarks/engine/bench_engine.py --model qwen3-8b --out $OUT/engine.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pdserve.bench.ceilings import measure
from pdserve.bench.record import new_record, save_json
from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams


def params_and_bytes(core: EngineCore) -> tuple[int, int]:
    n = sum(p.numel() for p in core.model.parameters())
    return n, sum(p.numel() * p.element_size() for p in core.model.parameters())


def kv_bytes_per_token(core: EngineCore) -> int:
    return core.block_bytes // core.config.block_size


def attn_flops(cfg, new_tokens: int, ctx_start: int) -> float:
    """Causal attention FLOPs for new_tokens appended after ctx_start tokens (QK^T and PV)."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pairs = new_tokens * ctx_start + new_tokens * (new_tokens + 1) / 2
    return 4 * pairs * cfg.num_attention_heads * hd * cfg.num_hidden_layers


def run_prefill(core: EngineCore, n_seqs: int, prompt_len: int, repeats: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    times = []
    for r in range(repeats + 1):
        for i in range(n_seqs):
            ids = torch.randint(0, core.hf_config.vocab_size, (prompt_len,), generator=g).tolist()
            core.add_request(f"p{r}-{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t = time.perf_counter()
        steps = 0
        while core.has_work():
            core.step()
            steps += 1
        torch.cuda.synchronize()
        if r:  # the first round warms up kernels and the allocator
            times.append(time.perf_counter() - t)
    core.kv.pool.reset_prefix_cache()
    dt = statistics.median(times)
    tokens = n_seqs * prompt_len
    n_params, _ = params_and_bytes(core)
    flops = 2 * n_params * tokens + n_seqs * attn_flops(core.hf_config, prompt_len, 0)
    return {"n_seqs": n_seqs, "prompt_len": prompt_len, "steps": steps, "seconds": dt, "tokens_per_s": tokens / dt,
            "tflops": flops / dt / 1e12}


def run_decode(core: EngineCore, batch: int, ctx: int, steps: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(0, core.hf_config.vocab_size, (ctx,), generator=g).tolist()
        core.add_request(f"d{batch}-{i}", ids, SamplingParams(max_tokens=steps + 50, ignore_eos=True, temperature=0))
    # run until every sequence is decoding
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(3):
        core.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()  # ends with the sampled tokens copied to the host: synchronous
        times.append(time.perf_counter() - t)
    avg_ctx = statistics.mean(r.num_tokens for r in core.scheduler.running)
    for rid in list(core.requests):
        core.abort_request(rid)
    core.kv.pool.reset_prefix_cache()
    _, wbytes = params_and_bytes(core)
    kv_read = batch * avg_ctx * kv_bytes_per_token(core)
    return {"batch": batch, "ctx": ctx, "avg_ctx": avg_ctx, "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_p90": sorted(times)[int(0.9 * len(times))] * 1e3, "bytes_per_step": wbytes + kv_read,
            "weight_bytes": wbytes, "kv_bytes_read": kv_read}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill", default="1x8192,8x1024,64x128", help="n_seqs x prompt_len")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", default="engine.json")
    args = ap.parse_args()
    rec = new_record("engine", vars(args))
    rec["ceilings"] = ceil = measure()
    print("ceilings:", ceil, flush=True)
    core = EngineCore(EngineConfig(model=args.model, load_format="dummy", max_num_seqs=512,
                                   max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=16384,
                                   attention_backend=args.attention_backend, gpu_memory_utilization=0.85))
    rec["engine"] = {"num_blocks": core.kv.pool.num_blocks, "backend": core.runner.backend.name,
                     "dtype": str(core.dtype), "block_bytes": core.block_bytes}
    res = {"prefill": [], "decode": []}
    for spec in args.prefill.split(","):
        n, plen = (int(x) for x in spec.split("x"))
        r = run_prefill(core, n, plen, repeats=3, seed=n)
        r["fraction_of_matmul_ceiling"] = r["tflops"] / ceil["bf16_matmul_tflops"]
        res["prefill"].append(r)
        print(f"prefill {n}x{plen}: {r['tokens_per_s']:.0f} tok/s, {r['tflops']:.0f} TFLOP/s "
              f"({r['fraction_of_matmul_ceiling']:.0%} of matmul)", flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        r = run_decode(core, b, args.ctx, args.steps, seed=b)
        floor_ms = r["bytes_per_step"] / (ceil["hbm_copy_gbps"] * 1e9) * 1e3
        r["floor_ms"] = floor_ms
        r["fraction_of_hbm_ceiling"] = floor_ms / r["step_ms_median"]
        res["decode"].append(r)
        print(f"decode batch {b}: {r['step_ms_median']:.2f} ms/step (floor {floor_ms:.2f} ms, "
              f"{r['fraction_of_hbm_ceiling']:.0%} of HBM)", flush=True)
    rec["results"] = res
    save_json(rec, args.out)
    print("| what | measured | ceiling fraction |\n|---|---|---|")
    for r in res["prefill"]:
        print(f"| prefill {r['n_seqs']}x{r['prompt_len']} | {r['tokens_per_s']:.0f} tok/s | "
              f"{r['fraction_of_matmul_ceiling']:.1%} of bf16 matmul |")
    for r in res["decode"]:
        print(f"| decode batch {r['batch']} ctx {r['ctx']} | {r['step_ms_median']:.2f} ms | "
              f"{r['fraction_of_hbm_ceiling']:.1%} of HBM |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

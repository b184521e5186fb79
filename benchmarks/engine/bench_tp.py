"""Decode step time at TP=1 and TP=2 (issue 12), so the all-reduce cost of tensor parallelism is on record.

For each tensor-parallel size a fresh engine process (this script with --child) builds hand-made decode batches
(every sequence with `--context` tokens of KV already in the pool, as bench_steps.py does) and times
`Executor.execute`: the step on every rank (the plan sent to the workers, inputs, forward with its all-reduces,
logits gathered to rank 0, sampling; it ends with the tokens on the host). With CUDA graphs (the default path) and
eagerly. Also measured in the same process:

  plan_send_us   rank 0's cost per step of sending the step's plan to the workers (encode + one send per worker)
  allreduce      2 * layers + 1 all-reduces of [batch, hidden] (what one decode step does: o_proj and down_proj of
                 every layer, the embedding), alone on every rank: eager and replayed from one CUDA graph

  python benchmarks/engine/bench_tp.py --model qwen3-8b --load-format dummy --out $OUT/tp_qwen3-8b.json
  CPU smoke run (numbers meaningless): --model PATH_TO_A_TINY_HF_DIR --device cpu --dtype float32 --batches 1,4 \
      --context 32 --iters 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the workers import allreduce_cost from this file as benchmarks.engine.bench_tp
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pdserve.bench.record import new_record, save_json  # noqa: E402


def allreduce_cost(worker, batch: int, per_step: int, iters: int) -> dict:
    """On every rank at once (collective_rpc): `per_step` all-reduces of [batch, hidden] in the model's dtype."""
    tp, dev = worker.tp, worker.device
    x = torch.zeros(batch, worker.hf_config.hidden_size, dtype=worker.dtype, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def one_step():
        for _ in range(per_step):
            tp.all_reduce(x)

    for _ in range(3):
        one_step()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        one_step()
    sync()
    out = {"bytes": x.numel() * x.element_size(), "per_step": per_step,
           "eager_ms": (time.perf_counter() - t) / iters * 1e3}
    if dev.type == "cuda" and tp.size > 1:
        g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            g.capture_begin(capture_error_mode="thread_local")
            one_step()
            g.capture_end()
        sync()
        for _ in range(3):
            g.replay()
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            g.replay()
        sync()
        out["graph_ms"] = (time.perf_counter() - t) / iters * 1e3
    return out


def time_steps(core, batch, iters: int, warmup: int) -> dict:
    runner = core.runner
    before = dict(runner.step_counts)
    for _ in range(warmup):
        core.executor.execute(batch)
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        core.executor.execute(batch)  # ends with the sampled tokens on the host
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    path = max(runner.step_counts, key=lambda k: runner.step_counts[k] - before.get(k, 0))
    return {"step_ms_median": statistics.median(times), "step_ms_p90": times[-(-9 * len(times) // 10) - 1],
            "step_ms_min": times[0], "path": path}


def child(args) -> dict:
    import random

    from benchmarks.engine import bench_tp
    from benchmarks.engine.bench_steps import build_batch
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore

    t0 = time.time()
    batches = [int(x) for x in args.batches.split(",")]
    core = EngineCore(EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                                   dtype=args.dtype, tensor_parallel_size=args.tp_size, max_num_seqs=max(batches),
                                   max_num_batched_tokens=max(args.max_num_batched_tokens, max(batches)),
                                   max_model_len=args.max_model_len, enable_prefix_caching=False,
                                   gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                                   tp_all_reduce=args.child_all_reduce, warmup=False))
    res: dict = {"tp": args.tp_size, "all_reduce": args.child_all_reduce, "start_s": time.time() - t0, "num_blocks": core.kv.pool.num_blocks,
                 "decode_graph_sizes": core.runner.decode_sizes, "cases": []}
    sends: list[float] = []
    if core.executor.size > 1:
        send = core.executor._send_step

        def timed_send(plan):
            t = time.perf_counter()
            send(plan)
            sends.append((time.perf_counter() - t) * 1e6)

        core.runner.step_sink = timed_send
    rng = random.Random(0)
    layers = core.hf_config.num_hidden_layers
    try:
        for b in batches:
            batch = build_batch(core, f"d{b}", [(args.context, 1, True)] * b, rng)
            if batch is None:
                res["cases"].append({"batch": b, "skipped": "does not fit the KV pool"})
                continue
            sends.clear()
            case = {"batch": b, "context": args.context, **time_steps(core, batch, args.iters, args.warmup)}
            if sends:
                case["plan_send_us_median"] = statistics.median(sends)
                case["plan_send_us_max"] = max(sends)
            if core.runner.decode_sizes or core.runner.mixed_sizes:
                core.runner.use_graphs = False
                case["eager"] = time_steps(core, batch, args.iters, args.warmup)
                core.runner.use_graphs = True
            if core.executor.size > 1:
                case["allreduce"] = core.executor.collective_rpc(bench_tp.allreduce_cost, b, 2 * layers + 1,
                                                                 args.iters)[0]
            for req in batch.requests:
                core.kv.free(req)
            res["cases"].append(case)
            print(f"TP={args.tp_size} ({args.child_all_reduce}) batch {b}: {case['step_ms_median']:.3f} ms "
                  f"({case['path']})", flush=True)
    finally:
        core.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    ap.add_argument("--all-reduce", default="nccl", help="TP>1: the sums to time, comma-separated (nccl, symm_mem)")
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--context", type=int, default=1024, help="tokens of KV per sequence")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="bounds the piecewise graphs captured")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine process")
    ap.add_argument("--out", default="tp.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--child-all-reduce", default="nccl", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        save_json(child(args), args.out)
        return 0

    rec = new_record("engine_tp", vars(args))
    runs = []
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    sums = args.all_reduce.split(",")
    plan = [(size, how) for size in (int(x) for x in args.tp.split(",")) for how in (sums if size > 1 else ["nccl"])]
    for tp, how in plan:
        with tempfile.TemporaryDirectory() as d:
            part = Path(d) / "part.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), *passthrough, "--child", "--tp-size", str(tp),
                   "--child-all-reduce", how, "--out", str(part)]
            print(f"== TP={tp} ({how})", flush=True)
            try:
                p = subprocess.run(cmd, timeout=args.timeout)
                code = p.returncode
            except subprocess.TimeoutExpired:
                code = "a timeout"
            if code != 0 or not part.exists():
                runs.append({"tp": tp, "all_reduce": how, "error": f"engine process exited with {code}"})
                save_json(rec | {"runs": runs}, args.out)
                continue
            runs.append(json.loads(part.read_text()))
            save_json(rec | {"runs": runs}, args.out)  # what is measured so far survives a limit on the whole run
    rec["runs"] = runs
    save_json(rec, args.out)
    print("\n| TP | sum | batch | step ms (median) | p90 | path | eager ms | plan send us | all-reduces/step ms "
          "(graph / eager) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        for c in r.get("cases", []):
            if "skipped" in c:
                continue
            ar = c.get("allreduce")
            ar_s = f"{ar.get('graph_ms', float('nan')):.3f} / {ar['eager_ms']:.3f}" if ar else "-"
            eager = f"{c['eager']['step_ms_median']:.3f}" if "eager" in c else "-"
            send = f"{c['plan_send_us_median']:.0f}" if "plan_send_us_median" in c else "-"
            print(f"| {r['tp']} | {r.get('all_reduce', 'nccl')} | {c['batch']} | {c['step_ms_median']:.3f} | {c['step_ms_p90']:.3f} | {c['path']} | "
                  f"{eager} | {send} | {ar_s} |")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Async scheduling on a GPU: the same requests through the engine with it on and off (dummy weights, greedy),
token ids compared, and the wall time of a steady decode batch each way (output tokens/s, steps overlapped).

  python benchmarks/engine/async_check.py --model qwen3-8b --out $OUT/async_check.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.record import new_record, save_json


def run(args, enabled: bool) -> dict:
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, async_scheduling=enabled,
              gpu_memory_utilization=0.85)
    rng = random.Random(0)
    vocab = llm.engine.hf_config.vocab_size
    check = [[rng.randrange(10, vocab - 10) for _ in range(rng.randrange(16, 700))] for _ in range(args.check)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 48), temperature=0, ignore_eos=True) for _ in check]
    outs = [r.outputs[0].token_ids for r in llm.generate(check, params)]
    res = {"async": llm.engine.async_scheduling, "tokens": outs}
    eng = llm.engine
    for batch in args.batches:  # steady decode only: timed from the step after every prompt had its first token
        p = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"b{batch}-{i}", [rng.randrange(10, vocab - 10) for _ in range(args.input_len)], p)
        started: set[str] = set()
        done = 0
        while len(started) < batch:
            for co in eng.step():
                started.add(co.request_id)
                done += co.finished
        torch.cuda.synchronize()
        steps0, t0, tokens = eng.num_steps, time.perf_counter(), 0
        while done < batch:
            for co in eng.step():
                tokens += len(co.new_token_ids)
                done += co.finished
        while eng.has_work():
            eng.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        steps = eng.num_steps - steps0
        res[f"batch_{batch}"] = {"seconds": dt, "output_tokens_per_s": tokens / dt, "steps": steps,
                                 "ms_per_step": 1e3 * dt / max(1, steps)}
    res["async_counts"] = dict(getattr(llm.engine, "async_counts", {}))
    llm.engine.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--check", type=int, default=48, help="requests whose greedy tokens are compared")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", choices=["on", "off"], default=None, help="(internal) one mode, JSON to --out")
    args = ap.parse_args(argv)
    if args.one is not None:  # each mode in its own process: a second engine in one process would find the GPU full
        Path(args.out).write_text(json.dumps(run(args, args.one == "on")))
        return 0
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("on", "off"):
            f = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--one", mode, "--out", str(f), "--model", args.model,
                   "--max-model-len", str(args.max_model_len), "--check", str(args.check), "--input-len",
                   str(args.input_len), "--output-len", str(args.output_len), "--batches", *map(str, args.batches)]
            subprocess.run(cmd, check=True)
            res[mode] = json.loads(f.read_text())
    on, off = res["on"], res["off"]
    same = sum(a == b for a, b in zip(on["tokens"], off["tokens"]))
    rec = new_record("async_check", vars(args))
    rec["identical_requests"] = same
    rec["requests"] = len(on["tokens"])
    for k in ("tokens",):
        on.pop(k), off.pop(k)
    rec["on"], rec["off"] = on, off
    print(f"greedy tokens identical with async on and off: {same}/{rec['requests']} requests")
    for b in args.batches:
        a, s = on[f"batch_{b}"], off[f"batch_{b}"]
        print(f"batch {b}: async {a['ms_per_step']:.2f} ms/step ({a['output_tokens_per_s']:.0f} tok/s), "
              f"sync {s['ms_per_step']:.2f} ms/step ({s['output_tokens_per_s']:.0f} tok/s): "
              f"{s['ms_per_step'] / a['ms_per_step']:.3f}x")
    print("async counts:", on["async_counts"])
    if args.out:
        save_json(rec, args.out)
    return 0 if same == rec["requests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

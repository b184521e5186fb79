"""Decode step time through the HTTP server against the engine's own step time at the same batch.

Why: the server must never be what limits decoding. The engine core runs in its own process, but if the HTTP
side consumed outputs too slowly (tokenizing, detokenizing, JSON, SSE writes for hundreds of streams), clients
would see tokens later than the engine makes them. This measures both sides with identical requests:

1. engine: `EngineCore` driven inline (no server, no IPC): median wall time of the steps in which all N requests
   are decoding;
2. server: `python -m pdserve.server` with the same flags, N concurrent streaming clients; the client-observed step
   time is the steady window (all streams started, none finished) divided by the median number of tokens a stream
   received in it. The engine process's own step time inside the server (from /load's `num_steps`) is reported
   too, so a gap can be attributed to the engine process or the HTTP side.

Target (issue 3): client-observed step time within 10% of the engine's own, with N=256 on one H200:

    python benchmarks/server/decode_step.py --model qwen3-8b --load-format dummy --batch 256 \
        --out benchmarks/server/results/decode_step_qwen3-8b_h200.json

A CPU smoke run of the mechanics (minutes, numbers meaningless):

    python benchmarks/server/decode_step.py --model qwen3-0.6b --load-format dummy --device cpu --batch 8 \
        --prompt-len 16 --max-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"pdserve: serving (\S+) on (http://\S+) \(role")
TARGET_RATIO = 1.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=256, help="concurrent requests (and --max-num-seqs)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=384, help="tokens per request; the steady window is shorter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the server to load")
    p.add_argument("--extra", default="", help="more server/engine flags, e.g. '--enforce-eager'")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--phase", choices=["both", "engine", "server"], default="both", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def engine_flags(a: argparse.Namespace) -> list[str]:
    max_len = a.prompt_len + a.max_tokens + 16
    return [
        "--model", a.model, "--load-format", a.load_format, "--device", a.device, "--dtype", a.dtype,
        "--max-num-seqs", str(a.batch), "--max-model-len", str(max_len), "--seed", str(a.seed),
        *a.extra.split(),
    ]  # fmt: skip


def prompts(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Distinct random prompts (the first token differs), so prefix caching cannot shorten any prefill."""
    rng = random.Random(a.seed)
    return [[i % vocab] + [rng.randrange(vocab) for _ in range(a.prompt_len - 1)] for i in range(a.batch)]


# ---------------------------------------------------------------------------------------------------------- engine
def run_engine(a: argparse.Namespace) -> dict:
    """Drive EngineCore inline; time the steps where every request is decoding."""
    import torch

    from pdserve.engine.engine_core import EngineCore
    from pdserve.sampling_params import SamplingParams
    from pdserve.server.main import add_arguments, build_config

    config = build_config(add_arguments(argparse.ArgumentParser()).parse_args(engine_flags(a))).engine
    core = EngineCore(config)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts(a, core.hf_config.vocab_size)):
        core.add_request(str(i), ids, params)
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    started: set[str] = set()
    steps: list[float] = []
    finished = False
    while core.has_work() and not finished:
        t0 = time.perf_counter()
        outs = core.step()
        sync()
        dt = time.perf_counter() - t0
        steady = len(started) == a.batch and len(outs) == a.batch
        for o in outs:
            started.add(o.request_id)
            finished |= o.finished
        if steady and not finished:
            steps.append(dt)
    if len(steps) < 10:
        raise SystemExit(f"only {len(steps)} steady decode steps: raise --max-tokens")
    warm = steps[len(steps) // 10 :]  # the first decode steps may still capture graphs or warm allocators
    return {"step_s_median": statistics.median(warm), "step_s_mean": statistics.fmean(warm), "steps": len(warm)}


# ---------------------------------------------------------------------------------------------------------- server
class Server:
    def __init__(self, a: argparse.Namespace):
        cmd = [sys.executable, "-m", "pdserve.server", "--port", "0", *engine_flags(a)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = READY.search(line)
                if m:
                    self.model, self.url = m.group(1), m.group(2)
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(a.start_timeout):
            self.stop()
            raise SystemExit("server did not start:\n" + "".join(self.lines[-50:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


async def drive(a: argparse.Namespace, url: str, model: str, vocab: int) -> dict:
    import aiohttp

    loads: list[tuple[float, int]] = []
    stop_polling = asyncio.Event()

    async def poll_load(s: aiohttp.ClientSession) -> None:
        while not stop_polling.is_set():
            async with s.get(url + "/load") as r:
                loads.append((time.perf_counter(), (await r.json()).get("num_steps", -1)))
            try:
                await asyncio.wait_for(stop_polling.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    async def stream(s: aiohttp.ClientSession, ids: list[int]) -> list[tuple[float, bytes]]:
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        events = []
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            async for line in r.content:  # parse later: keep the client light while it measures
                if line.startswith(b"data: {"):
                    events.append((time.perf_counter(), line))
        return events

    connector = aiohttp.TCPConnector(limit=a.batch + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        poller = asyncio.create_task(poll_load(s))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream(s, ids) for ids in prompts(a, vocab)))
        wall = time.perf_counter() - t0
        stop_polling.set()
        await poller

    per_stream = []  # [(time, completion_tokens so far)]
    for events in results:
        seq = []
        for t, line in events:
            usage = json.loads(line[len(b"data: ") :]).get("usage")
            if usage:
                seq.append((t, usage["completion_tokens"]))
        if not seq or seq[-1][1] != a.max_tokens:
            raise RuntimeError(f"a stream ended with {seq[-1][1] if seq else 0} of {a.max_tokens} tokens")
        per_stream.append(seq)
    start = max(seq[0][0] for seq in per_stream)  # every stream has its first token
    end = min(seq[-1][0] for seq in per_stream)  # no stream has finished
    if end - start <= 0:
        raise SystemExit("no steady window (all streams decoding): raise --max-tokens")

    def tokens_in(seq, lo, hi):
        inside = [n for t, n in seq if lo <= t <= hi]
        return inside[-1] - inside[0] if len(inside) >= 2 else 0

    tokens = [tokens_in(seq, start, end) for seq in per_stream]
    client_step = (end - start) / statistics.median(tokens)
    inside = [(t, n) for t, n in loads if start <= t <= end and n >= 0]
    engine_in_server = (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]) if len(inside) >= 2 else None
    return {
        "client_step_s": client_step,
        "engine_step_in_server_s": engine_in_server,
        "window_s": end - start,
        "tokens_per_stream_in_window_median": statistics.median(tokens),
        "wall_s": wall,
        "output_tokens_per_s": a.batch * a.max_tokens / wall,
    }


def run_server(a: argparse.Namespace) -> dict:
    server = Server(a)
    try:
        from pdserve.server.main import run_loop  # uvloop where installed: keeps the client's own overhead small

        vocab = model_vocab(a)
        return run_loop(drive(a, server.url, server.model, vocab))
    finally:
        server.stop()


def model_vocab(a: argparse.Namespace) -> int:
    """The smaller of the model's and the tokenizer's vocabularies: every prompt id is valid for both."""
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.model.dummy_tokenizer import tokenizer_path_for
    from pdserve.model.loader import load_config, resolve_model

    src = resolve_model(a.model)
    cfg, _ = load_config(src)
    return min(cfg.vocab_size, Tokenizer.load(tokenizer_path_for(src)).vocab_size)


def sub_phase(phase: str) -> dict:
    """Each phase in its own process, so the GPU memory of one is gone before the other starts."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.phase == "engine":
        print(json.dumps(run_engine(a)))
        return 0
    if a.phase == "server":
        print(json.dumps(run_server(a)))
        return 0
    engine = sub_phase("engine")
    server = sub_phase("server")
    ratio = server["client_step_s"] / engine["step_s_median"]
    result = {
        "benchmark": "decode step time through the server vs the engine alone",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": platform.node(),
        "gpu": gpu_name(),
        "args": {k: v for k, v in vars(a).items() if k != "phase"},
        "engine": engine,
        "server": server,
        "ratio_client_over_engine": ratio,
        "target_ratio": TARGET_RATIO,
        "pass": ratio <= TARGET_RATIO,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(
        f"engine step {engine['step_s_median'] * 1e3:.2f} ms, through the server {server['client_step_s'] * 1e3:.2f} ms"
        f" (ratio {ratio:.3f}, target <= {TARGET_RATIO}): {'PASS' if result['pass'] else 'FAIL'}",
        file=sys.stderr,
    )
    return 0 if result["pass"] else 1


def gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

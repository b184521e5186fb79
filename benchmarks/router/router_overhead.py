"""What the router itself costs (CPU only; no model): TTFT and per-request latency added over talking to the
instance directly, and streamed-chunk throughput, against an instant fake decode instance.

The fake answers at once, so every millisecond measured is HTTP + router work. Client, router and fake run in
three processes (as in a deployment). Runs anywhere:
  python benchmarks/router/router_overhead.py --requests 300 --concurrency 1 8 64 --out results.json
  python benchmarks/router/router_overhead.py --requests 50 --concurrency 1 --prompt-tokens 32768  # long prompts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from pdserve import stats
from pdserve.bench.record import new_record

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "router" / "fake_instance.py"  # the fake instance lives with the router tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


def pct(xs: list[float], q: float) -> float:
    return stats.percentile(xs, 100 * q)


def make_prompt(prompt_tokens: int, seed: int = 0) -> str | list[int]:
    """A 50-word text prompt, or `prompt_tokens` random token ids (what a benchmark client sends for long prompts)."""
    if not prompt_tokens:
        return "hello " * 50
    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(prompt_tokens)]


async def one(session: aiohttp.ClientSession, url: str, max_tokens: int,
              prompt: str | list[int]) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft, chunks = None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0, chunks


async def drive(url: str, n: int, concurrency: int, max_tokens: int, prompt: str | list[int]) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def bounded():
            async with sem:
                return await one(session, url, max_tokens, prompt)

        await asyncio.gather(*(bounded() for _ in range(min(20, n))))  # warm connections
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(bounded() for _ in range(n)))
        wall = time.perf_counter() - t0
    ttft = [r[0] for r in rs]
    e2e = [r[1] for r in rs]
    return {"ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "e2e_p50_ms": 1000 * pct(e2e, 0.5), "e2e_mean_ms": 1000 * statistics.fmean(e2e),
            "chunks_per_s": sum(r[2] for r in rs) / wall, "requests_per_s": n / wall}


async def main_async(args: argparse.Namespace) -> dict:
    fake_port, router_port = free_port(), free_port()
    fake_url, router_url = f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{router_port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(FAKE), "--role", "decode", "--port", str(fake_port)], env=env),
             subprocess.Popen([sys.executable, "-m", "pdserve.router", "--decode", fake_url, "--port",
                               str(router_port), "--max-inflight-per-instance", "4096", "--log-level", "warning"],
                              env=env)]
    results = {}
    try:
        await wait_healthy(fake_url)
        await wait_healthy(router_url)
        for c in args.concurrency:
            prompt = make_prompt(args.prompt_tokens)
            direct = await drive(fake_url, args.requests, c, args.max_tokens, prompt)
            routed = await drive(router_url, args.requests, c, args.max_tokens, prompt)
            results[str(c)] = {"direct": direct, "router": routed,
                               "added_ttft_p50_ms": routed["ttft_p50_ms"] - direct["ttft_p50_ms"]}
            print(f"concurrency {c}: TTFT p50 direct {direct['ttft_p50_ms']:.2f} ms, via router "
                  f"{routed['ttft_p50_ms']:.2f} ms; chunks/s direct {direct['chunks_per_s']:.0f}, via router "
                  f"{routed['chunks_per_s']:.0f}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="send this many random token ids as the prompt (0: a 50-word text prompt)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    if args.out:
        doc = {"benchmark": "router_overhead", "command": [sys.executable, *sys.argv], "args": vars(args),
               "git_commit": new_record("router_overhead", vars(args))["git_commit"],
               "host": {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()},
               "results": results}
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The client's own capacity: the same request code driven against a zero-work endpoint.

A benchmark whose client saturates measures the client. Before a run we measure how many requests and
streamed tokens per second this process can handle against `zero_server` (a child process in our process
group, so it dies with us), with the run's concurrency and a similar output length, and flag any run whose
throughput came within a factor of 3 of that ceiling.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp

from pdserve.bench.client import EndpointConfig, RequestResult, send_request
from pdserve.bench.datasets import BenchRequest

SAFETY_FACTOR = 3.0


async def _start_zero_server(timeout_s: float = 30.0) -> tuple[asyncio.subprocess.Process, int]:
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this same pdserve from any cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.bench.zero_server", "--port", "0",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        raise RuntimeError(f"the zero-work endpoint did not start within {timeout_s:g} s") from None
    if not line.startswith(b"PORT "):
        proc.kill()
        raise RuntimeError(f"the zero-work endpoint failed to start (said {line!r})")
    return proc, int(line.split()[1])


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


async def measure_capacity(
    endpoint: EndpointConfig, output_len: int, concurrency: int, duration_s: float = 2.0
) -> dict:
    """Closed-loop requests against the zero-work endpoint for `duration_s`; requests/s and tokens/s achieved."""
    # Every worker finishes the request it has in flight, so the probe costs at least concurrency x output_len
    # chunks; 256 tokens keeps that near `duration_s` at 256 streams while per-request overhead stays small.
    output_len = max(1, min(int(output_len), 256))
    concurrency = max(1, min(int(concurrency), 512))
    proc, port = await _start_zero_server()
    cfg = replace(endpoint, base_url=f"http://127.0.0.1:{port}", request_timeout_s=30.0, api_key=None)
    req = BenchRequest(prompt="capacity probe", prompt_len=2, output_len=output_len,
                       messages=[{"role": "user", "content": "capacity probe"}] if cfg.chat else None)
    done, tokens, errors = 0, 0, []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await send_request(session, cfg, req, RequestResult(index=-1))  # warm the connection path
            t_end = time.perf_counter() + duration_s

            async def worker() -> None:
                nonlocal done, tokens
                while time.perf_counter() < t_end:
                    r = await send_request(session, cfg, req, RequestResult(index=-1))
                    if r.success:
                        done, tokens = done + 1, tokens + r.num_chunks
                    else:
                        errors.append(r.error)
                        return

            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), duration_s + 60.0)
            elapsed = time.perf_counter() - t0
    finally:
        await _stop(proc)
    if errors and not done:
        raise RuntimeError(f"client capacity probe failed: {errors[0]}")
    return {
        "request_throughput": done / elapsed,
        "output_throughput": tokens / elapsed,
        "concurrency": concurrency,
        "output_len": output_len,
        "duration": elapsed,
    }


def capacity_warning(metrics: dict, capacity: dict | None) -> str | None:
    """A warning when the run's request or token rate came within SAFETY_FACTOR of the client's ceiling."""
    if not capacity:
        return None
    notes = []
    for key, label in (("request_throughput", "req/s"), ("output_throughput", "tok/s")):
        cap, got = capacity.get(key, math.inf), metrics.get(key, 0.0)
        if cap > 0 and got * SAFETY_FACTOR > cap:
            notes.append(f"{got:.1f} {label} is more than 1/{SAFETY_FACTOR:g} of the client's capacity {cap:.1f}")
    if not notes:
        return None
    return "the benchmark client may be the bottleneck: " + "; ".join(notes)

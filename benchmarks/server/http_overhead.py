"""The HTTP side's cost per streamed token, without a model: runs on any CPU.

Why: decode_step.py needs a GPU. This isolates what the server adds per token (queue wake-up, chunk JSON, SSE
write, metrics) by putting the real app around a clock engine that emits one token to every open stream each
`--step-ms`, as the engine process's pipe reader does, and reading the server process's CPU time while N
streaming clients (in another process) consume. Reported: server CPU microseconds per streamed token, the
server's CPU utilisation, and the step time the clients observe against the clock's. A server whose
utilisation nears 1.0 would delay tokens; at 20 us a token one core streams ~50k tokens/s.

    python benchmarks/server/http_overhead.py --streams 256 --step-ms 25 --out benchmarks/server/results/http_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import web

from pdserve.config import EngineConfig, ServerConfig
from pdserve.engine.outputs import RequestOutput


class WordTokenizer:
    """Enough tokenizer for the server's prompt handling: every prompt is a fixed three tokens."""

    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2, 3]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


class ClockEngine:
    """AsyncLLM's interface; a timer emits one token to every open stream per step, like one engine step would."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.tokenizer = WordTokenizer()
        self.model_name = "clock"
        self.max_model_len = 1 << 20
        self.streams: dict[str, list] = {}
        self.steps = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            deadline += self.step_s
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            if not self.streams:
                continue
            self.steps += 1
            for rid, st in list(self.streams.items()):
                st[1] += 1
                done = st[1] >= st[0]
                out = RequestOutput(rid, [7], " t7", done, "length" if done else None, None, 3, st[1])
                st[2].put_nowait(out)
                if done:
                    del self.streams[rid]

    def stats(self) -> dict:
        return {"num_running": len(self.streams), "num_waiting": 0, "num_steps": self.steps}

    async def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def generate(self, request_id, prompt_token_ids, params, pd=None):
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = [params.max_tokens, 0, q]
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            self.streams.pop(request_id, None)


async def serve(port: int, step_s: float) -> None:
    llm = ClockEngine(step_s)
    app = create_app_with_cpu_route(llm)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"ready http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await llm.run()


def create_app_with_cpu_route(llm: ClockEngine) -> web.Application:
    from pdserve.server.app import create_app

    async def cpu(request: web.Request) -> web.Response:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return web.json_response({"cpu_s": ru.ru_utime + ru.ru_stime, "t": time.perf_counter(), "steps": llm.steps})

    return create_app(
        llm, ServerConfig(engine=EngineConfig(model="clock")), lambda app: app.router.add_get("/cpu", cpu)
    )


async def drive(url: str, streams: int, tokens: int, settle_s: float, measure_s: float) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams + 4)) as s:

        async def cpu() -> dict:
            async with s.get(url + "/cpu") as r:
                return await r.json()

        async def one() -> list[float]:
            body = {"prompt": "x", "max_tokens": tokens, "stream": True}
            times = []
            async with s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        times.append(time.perf_counter())
            return times

        task = asyncio.gather(*(one() for _ in range(streams)))
        await asyncio.sleep(settle_s)
        c0 = await cpu()
        await asyncio.sleep(measure_s)
        c1 = await cpu()
        results = await task
    steps = c1["steps"] - c0["steps"]
    if steps <= 0:
        raise SystemExit("no engine steps in the window: streams finished early; raise --tokens")
    start, end = max(t[0] for t in results), min(t[-1] for t in results)
    per_stream = statistics.median(sum(1 for x in t if start <= x <= end) - 1 for t in results)
    cpu_s = c1["cpu_s"] - c0["cpu_s"]
    return {
        "server_cpu_us_per_token": 1e6 * cpu_s / (steps * streams),
        "server_cpu_utilisation": cpu_s / (c1["t"] - c0["t"]),
        "clock_step_ms": 1e3 * (c1["t"] - c0["t"]) / steps,
        "client_step_ms": 1e3 * (end - start) / per_stream,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=25.0)
    p.add_argument("--tokens", type=int, default=0, help="tokens per stream (default: enough for the window)")
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--measure-s", type=float, default=4.0)
    p.add_argument("--out", default=None)
    p.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from pdserve.server.main import run_loop

    if a.serve_port is not None:
        run_loop(serve(a.serve_port, a.step_ms / 1e3))
        return 0
    tokens = a.tokens or int((a.settle_s + a.measure_s + 2.0) / (a.step_ms / 1e3))
    cmd = [sys.executable, __file__, "--serve-port", "0", "--step-ms", str(a.step_ms)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = server.stdout.readline()
        if not line.startswith("ready "):
            raise SystemExit(f"server did not start: {line!r}")
        numbers = run_loop(drive(line.split()[1], a.streams, tokens, a.settle_s, a.measure_s))
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = {
        "benchmark": "HTTP server cost per streamed token (clock engine, no model)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "event_loop": event_loop_name(),
        "args": {"streams": a.streams, "step_ms": a.step_ms, "tokens": tokens, "measure_s": a.measure_s},
        **numbers,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


def event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


if __name__ == "__main__":
    sys.exit(main())

"""A controllable OpenAI-compatible streaming endpoint for benchmark tests, run in a background thread.

Behaviours: normal streaming with set delays; HTTP errors; malformed SSE; a stream cut before [DONE]; an error
event; and a latency that jumps once the observed arrival rate exceeds a threshold (for the SLO search).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behaviour:
    mode: str = "ok"  # ok | http_500 | malformed | no_done | error_event | rate_threshold | fail_every
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    tokens_per_chunk: int = 1
    report_usage: bool = True
    rate_threshold: float = 0.0  # rate_threshold mode: arrivals/s above which TTFT becomes slow_ttft_s
    slow_ttft_s: float = 0.3
    rate_window: int = 8
    fail_every: int = 0  # fail_every mode: every n-th request answers HTTP 503
    arrivals: list = field(default_factory=list)
    count: int = 0
    bodies: list = field(default_factory=list)


def _event(chat: bool, text: str) -> bytes:
    if chat:
        ev = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    else:
        ev = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return f"data: {json.dumps(ev)}\n\n".encode()


BEHAVIOUR = web.AppKey("behaviour", Behaviour)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "fake-model"}]})


async def _handle(request: web.Request) -> web.StreamResponse:
    try:
        return await _respond(request)
    except ConnectionError:  # the benchmark cancelled the request (early stop, Ctrl-C): nothing to do
        return web.Response(status=499)


async def _respond(request: web.Request) -> web.StreamResponse:
    b: Behaviour = request.app[BEHAVIOUR]
    now = time.perf_counter()
    b.arrivals.append(now)
    b.count += 1
    body = await request.json()
    b.bodies.append(body)
    chat = request.path.endswith("/chat/completions")
    n = int(body.get("max_tokens", 16))
    if b.mode == "http_500" or (b.mode == "fail_every" and b.count % b.fail_every == 0):
        status = 500 if b.mode == "http_500" else 503
        return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=status)
    ttft = b.ttft_s
    if b.mode == "rate_threshold" and len(b.arrivals) > b.rate_window:
        span = b.arrivals[-1] - b.arrivals[-1 - b.rate_window]
        if span > 0 and b.rate_window / span > b.rate_threshold:
            ttft = b.slow_ttft_s
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(ttft)
    if b.mode == "malformed":
        await resp.write(_event(chat, " t1"))
        await resp.write(b"data: {not json\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if b.mode == "error_event":
        await resp.write(b'data: {"error": {"message": "out of blocks", "code": 503}}\n\n')
        return resp
    sent = 0
    while sent < n:
        k = min(b.tokens_per_chunk, n - sent)
        if sent and b.tpot_s:
            await asyncio.sleep(b.tpot_s * k)
        await resp.write(_event(chat, "".join(f" t{sent + j}" for j in range(k))))
        sent += k
        if b.mode == "no_done" and sent >= max(1, n // 2):
            return resp
    if b.report_usage:
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
        await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


class FakeServer:
    """`with FakeServer(Behaviour(...)) as srv: srv.url` serves until the block ends."""

    def __init__(self, behaviour: Behaviour | None = None):
        self.behaviour = behaviour or Behaviour()
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app[BEHAVIOUR] = self.behaviour
        app.router.add_post("/v1/completions", _handle)
        app.router.add_post("/v1/chat/completions", _handle)
        app.router.add_get("/v1/models", _models)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

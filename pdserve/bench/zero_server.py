"""A zero-work OpenAI-compatible endpoint: streams N tokens instantly, to measure the benchmark client's ceiling.

Responses are pre-built SSE events in OpenAI's format (one token per event, a usage event, `data: [DONE]`)
written back to back, so the server spends almost nothing per token and the measured rate is the client's.
Run as `python -m pdserve.bench.zero_server --port 0`; it prints `PORT <n>` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from functools import lru_cache

from aiohttp import web


@lru_cache(maxsize=64)
def sse_events(n_tokens: int, chat: bool) -> tuple[bytes, ...]:
    base = {"id": "cmpl-zero", "created": 0, "model": "zero"}
    events = []
    for i in range(n_tokens):
        if chat:
            ev = {**base, "object": "chat.completion.chunk",
                  "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
        else:
            ev = {**base, "object": "text_completion",
                  "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}]}
        events.append(ev)
    events.append({**base, "choices": [],
                   "usage": {"prompt_tokens": 1, "completion_tokens": n_tokens, "total_tokens": n_tokens + 1}})
    return tuple(f"data: {json.dumps(e)}\n\n".encode() for e in events) + (b"data: [DONE]\n\n",)


async def _complete(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for ev in sse_events(n, request.path.endswith("/chat/completions")):
        # One write per event and a yield between them, so concurrent streams interleave and the client sees
        # events one or a few per read, as from a real server; a single pre-joined body would be parsed in big
        # reads and overstate the client's capacity several times.
        await resp.write(ev)
        await asyncio.sleep(0)
    await resp.write_eof()
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "zero", "object": "model"}]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


async def serve(port: int, host: str = "127.0.0.1") -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=4096).start()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    # Exit when the parent closes our stdin, so the server never outlives the benchmark that started it.
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()
    await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    asyncio.run(serve(args.port, args.host))


if __name__ == "__main__":
    main()

"""A fake pdserve instance for router tests: the instance protocol (OpenAI routes, /load, /health, /v1/abort,
`pd` and `pd_timings`) with controllable delays and failures, and a record of what it saw.

Runs in-process (FakeInstance.start) or as a process (`python tests/router/fake_instance.py --role decode --port N`,
for the launcher test). Output text is a deterministic function of max_tokens only, so a retried request gives the
same answer on any instance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.signing import verify_request


@dataclass
class Behavior:
    token_delay_s: float = 0.0  # between streamed tokens
    first_delay_s: float = 0.0  # before the first token (or before the whole non-streamed body)
    fail_status: int | None = None  # answer every generate request with this status
    fail_headers: dict[str, str] = field(default_factory=dict)  # ... and these headers
    die_after_tokens: int | None = None  # abort the connection after this many tokens (simulated crash)
    load_delay_s: float = 0.0  # /load answers this late (a busy or hung instance)
    load_status: int = 200
    load: dict[str, Any] = field(default_factory=dict)  # /load field overrides


class FakeInstance:
    def __init__(self, role: str = "decode", name: str = "fake", model: str = "fake-model",
                 secret: bytes | None = None) -> None:
        self.role = role
        self.name = name
        self.model = model
        self.secret = secret  # when set, `pd` orders and aborts must be signed with it (as a real instance checks)
        self.authorization: list[str | None] = []  # the Authorization header of every generate request
        self.behavior = Behavior()
        self.requests: list[dict[str, Any]] = []  # bodies received on generate routes
        self.paths: list[str] = []
        self.aborts: list[str] = []
        self.disconnects = 0  # generate handlers cut short by the router closing the connection
        self.completed = 0
        self.active = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._transports: set[Any] = set()

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/load", self.load)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/abort", self.abort)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        bound = self._site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def kill(self) -> None:
        """Like SIGKILL: stop listening (connections are refused) and drop every open connection at once."""
        if self._site is not None and self._site._server is not None:
            self._site._server.close()
        for transport in list(self._transports):
            transport.abort()
        if self._runner is not None and self._runner.server is not None:
            for proto in list(self._runner.server.connections):
                if proto.transport is not None:
                    proto.transport.abort()

    # ---- routes ----

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"fake_active {self.active}\n")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "x"}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """One token per character (its code point)."""
        self.paths.append(request.path)
        tokens = [ord(c) for c in (await request.json())["prompt"]]
        return web.json_response({"count": len(tokens), "max_model_len": 1024, "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        return web.json_response({"prompt": "".join(chr(t) for t in (await request.json())["tokens"])})

    async def abort(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if self.secret is not None:
            verify_request(self.secret, request, raw)
        body = json.loads(raw)
        self.aborts.append(body.get("request_id"))
        return web.json_response({"aborted": True})

    async def load(self, request: web.Request) -> web.Response:
        b = self.behavior
        if b.load_delay_s:
            await asyncio.sleep(b.load_delay_s)
        data = {"num_running": self.active, "num_waiting": 0, "running_tokens": 10 * self.active,
                "waiting_tokens": 0, "kv_usage": 0.0, "num_free_blocks": 100, "num_total_blocks": 100,
                "role": self.role}
        data.update(b.load)
        return web.json_response(data, status=b.load_status)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        if "pd" in body and self.secret is not None:
            verify_request(self.secret, request, raw)
        self.authorization.append(request.headers.get("Authorization"))
        self.requests.append(body)
        self.paths.append(request.path)
        self.active += 1
        try:
            b = self.behavior
            if b.fail_status is not None:
                return web.json_response({"error": {"message": "fake failure", "type": "x", "code": b.fail_status}},
                                         status=b.fail_status, headers=b.fail_headers)
            if b.first_delay_s:
                await asyncio.sleep(b.first_delay_s)
            chat = request.path.endswith("/chat/completions")
            n = int(body.get("max_tokens") or 4)
            tokens = [f" t{i}" for i in range(n)]
            timings = {"queue_s": 0.001, "prefill_s": 0.002, "handover_s": 0.003 if "pd" in body else 0.0,
                       "first_token_s": 0.004, "prefill_url": (body.get("pd") or {}).get("prefill_urls", [None])[0],
                       "fallback": None if "pd" in body else "local"}
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
            if not body.get("stream"):
                if b.die_after_tokens is not None:
                    await asyncio.sleep(b.token_delay_s * b.die_after_tokens)
                    request.transport.abort()
                    await asyncio.sleep(3600)
                text = "".join(tokens)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
                out = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                       "created": int(time.time()), "model": self.model, "choices": [choice], "usage": usage,
                       "pd_timings": timings}
                self.completed += 1
                return web.json_response(out)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            self._transports.add(request.transport)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            for i, tok in enumerate(tokens):
                if b.die_after_tokens is not None and i == b.die_after_tokens:
                    request.transport.abort()
                    await asyncio.sleep(3600)
                if i and b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
                last = i == n - 1
                if chat:
                    choice = {"index": 0, "delta": {"content": tok}, "finish_reason": "length" if last else None}
                else:
                    choice = {"index": 0, "text": tok, "logprobs": None, "finish_reason": "length" if last else None}
                chunk = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": 0, "model": self.model, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if include_usage:
                final = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.model,
                         "choices": [], "usage": usage, "pd_timings": timings}
                await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            self.active -= 1
            self._transports.discard(request.transport)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", default="both")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args, _unknown = parser.parse_known_args()  # the launcher passes instance flags this fake ignores
    fake = FakeInstance(role=args.role)
    web.run_app(fake.make_app(), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()

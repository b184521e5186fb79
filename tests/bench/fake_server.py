"""A scripted OpenAI-compatible streaming endpoint with exactly known timings, run in a background thread (or, by
FakeServerProcess, in a process of its own).

The script: the first token chunk `ttft_s` after the request arrives, then one chunk every `itl_s` (on an
absolute schedule, so sleeps do not drift), or with steps that make every TTFT and every gap different;
optionally some chunks with empty text; optionally a trailing usage-only chunk `usage_delay_s` after the last
token; HTTP errors for every `fail_every`-th request (by the number at the end of its x-request-id) or for the
first `fail_first` requests. The server records, per request, when it arrived and when each chunk actually left
(after the write returned), so a test computes the truth from what was really sent rather than what was meant.

`mode="queue"` models a server whose latency grows with load: one FIFO prefill lane in which a prompt of n
words takes n x `prefill_s_per_token`; the first token leaves when the request's prefill is done, and a request
the client abandons leaves the lane at once. Other modes produce broken streams: malformed, no_done,
error_event, http_error (every request fails).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    mode: str = "ok"  # ok | queue | malformed | no_done | error_event | http_error
    ttft_s: float = 0.0
    itl_s: float = 0.0
    ttft_step_s: float = 0.0  # request i (by its id) waits ttft_s + i * ttft_step_s for its first chunk
    itl_step_s: float = 0.0  # gap g of the whole run is itl_s + itl_step_s * ((37 g) mod 101): all different
    tokens_per_chunk: int = 1
    usage: bool = True  # a trailing usage-only chunk (choices: [])
    usage_delay_s: float = 0.0  # ... sent this long after the last token chunk
    empty_chunks: tuple[int, ...] = ()  # token chunks (0-based) sent with empty text, e.g. a special token
    fail_every: int = 0  # request <prefix><i> with i % fail_every == fail_every - 1 answers HTTP fail_status
    fail_status: int = 500
    fail_first: int = 0  # the first n requests answer HTTP 503 (a server still starting)
    prefill_s_per_token: float = 0.0  # queue mode


@dataclass
class Record:
    """What the server saw and did for one request (times on the time.perf_counter clock)."""

    request_id: str | None
    index: int | None  # the number at the end of the request id
    arrival: float
    body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    status: int = 200
    prompt_words: int = 0
    chunk_times: list[float] = field(default_factory=list)  # token chunks only
    chunk_texts: list[str] = field(default_factory=list)
    usage_time: float | None = None
    end: float | None = None  # after data: [DONE] was written

    @property
    def tokens(self) -> int:
        return len(self.chunk_times)


def prompt_tokens(words: int) -> int:
    """What the fake server reports as usage.prompt_tokens: the prompt's words plus one, like a BOS token."""
    return words + 1


def _event(chat: bool, text: str) -> bytes:
    if chat:
        ev = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    else:
        ev = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return f"data: {json.dumps(ev)}\n\n".encode()


class _State:
    def __init__(self, script: Script):
        self.script = script
        self.records: list[Record] = []
        self.lane: dict[int, float] = {}  # queue mode: prefill-done time of each request holding the lane


STATE = web.AppKey("state", _State)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "root": "fake-root"}]})


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _handle(request: web.Request) -> web.StreamResponse:
    try:
        return await _respond(request)
    except ConnectionError:  # the benchmark cancelled the request (early stop, Ctrl-C): nothing to do
        return web.Response(status=499)
    finally:
        request.app[STATE].lane.pop(id(request), None)  # done or aborted: it no longer holds the prefill lane


async def _respond(request: web.Request) -> web.StreamResponse:
    st: _State = request.app[STATE]
    s = st.script
    arrival = time.perf_counter()
    rid = request.headers.get("x-request-id")
    m = re.search(r"(\d+)$", rid or "")
    rec = Record(request_id=rid, index=int(m.group(1)) if m else None, arrival=arrival, headers=dict(request.headers))
    st.records.append(rec)
    rec.body = body = await request.json()
    chat = request.path.endswith("/chat/completions")
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    rec.prompt_words = len(str(prompt).split())
    n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    failing = s.fail_every and rec.index is not None and rec.index % s.fail_every == s.fail_every - 1
    if s.mode == "http_error" or failing or len(st.records) <= s.fail_first:
        status = 503 if len(st.records) <= s.fail_first else s.fail_status
        rec.status, rec.end = status, time.perf_counter()
        return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=status)
    first = arrival + s.ttft_s + (rec.index or 0) * s.ttft_step_s
    if s.mode == "queue":  # FIFO behind every request still prefilling (an aborted one frees its place)
        start = max([arrival, *st.lane.values()])
        st.lane[id(request)] = first = start + rec.prompt_words * s.prefill_s_per_token
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await _sleep_until(first)
    if s.mode == "malformed":
        await resp.write(_event(chat, " t1"))
        await resp.write(b"data: {not json\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if s.mode == "error_event":
        await resp.write(b'data: {"error": {"message": "out of blocks", "code": 503}}\n\n')
        return resp
    sent, k, due = 0, 0, first
    while sent < n:
        c = min(s.tokens_per_chunk, n - sent)
        if k:
            g = (rec.index or 0) * n + k
            due += s.itl_s + s.itl_step_s * ((37 * g) % 101)
        await _sleep_until(due)
        text = "" if k in s.empty_chunks else "".join(f" t{sent + j}" for j in range(c))
        k += 1
        await resp.write(_event(chat, text))
        rec.chunk_times.append(time.perf_counter())
        rec.chunk_texts.append(text)
        sent += c
        if s.mode == "no_done" and sent >= max(1, n // 2):
            return resp
    if s.usage:
        await _sleep_until(rec.chunk_times[-1] + s.usage_delay_s)
        usage = {"prompt_tokens": prompt_tokens(rec.prompt_words), "completion_tokens": sent,
                 "total_tokens": prompt_tokens(rec.prompt_words) + sent}
        await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
        rec.usage_time = time.perf_counter()
    await resp.write(b"data: [DONE]\n\n")
    rec.end = time.perf_counter()
    return resp


class FakeServer:
    """`with FakeServer(Script(...)) as srv: srv.url` serves until the block ends; `srv.records` is what it did."""

    def __init__(self, script: Script | None = None):
        self.state = _State(script or Script())
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def script(self) -> Script:
        return self.state.script

    @property
    def records(self) -> list[Record]:
        return self.state.records

    def bench_records(self, prefix: str) -> dict[int, Record]:
        """The benchmark's requests (x-request-id <prefix><i>) by index i; probes and warm-ups carry no id."""
        return {r.index: r for r in self.records if r.request_id and r.request_id.startswith(prefix)}

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app[STATE] = self.state
        app.router.add_post("/v1/completions", _handle)
        app.router.add_post("/v1/chat/completions", _handle)
        app.router.add_get("/v1/models", _models)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
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


class FakeServerProcess:
    """`with FakeServerProcess(Script(...)) as srv: srv.url`: the same server in a spawned process of its own, for a
    test whose verdicts rest on the server's latency: its clock then shares no interpreter lock, garbage collector
    or leftover threads with the test process (in a full run that process holds what a thousand tests left). What
    it recorded stays in the child; such a test checks what the client measured."""

    def __init__(self, script: Script | None = None):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_in_child, args=(script or Script(), child), daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServerProcess:
        self._proc.start()
        if not self._conn.poll(60):
            self._proc.kill()
            raise RuntimeError("fake server process did not start")
        self.port = self._conn.recv()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def _serve_in_child(script: Script, conn) -> None:
    with FakeServer(script) as srv:
        conn.send(srv.port)
        try:
            conn.recv()  # until the parent says stop, or its end of the pipe closes
        except EOFError:
            pass

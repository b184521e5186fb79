"""Running one HTTP request's choices through the engine and answering it, streamed or whole.

A request becomes one engine request per choice (n per prompt, several prompts): ids `<rid>-<k>` (plain `<rid>`
when there is one choice), each with its own `pd` order and, for n > 1, vLLM's child seed (`seed + i`). Their
outputs are merged into one response or one SSE stream with the choices' indexes, usage summed.

Why the care with closing: a request whose client went away must give its KV blocks back. aiohttp cancels the
handler when the peer disconnects (the runner is started with handler_cancellation=True) and a write to a closed
stream raises; either way the `finally` below closes every engine generator and aborts what did not finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve import protocol as P
from pdserve.engine.messages import ImportParams
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import EngineDead, PromptTooLong, QueueFull
from pdserve.sampling_params import InvalidParameter, SamplingParams
from pdserve.server.formats import Choice, OutputFormat
from pdserve.server.metrics import RequestTracker
from pdserve.server.state import ServerState

log = logging.getLogger("pdserve.server")

CLOSE_TIMEOUT_S = 5.0  # bound on waiting for a choice's pump task to wind down


@dataclass
class Child:
    """One engine request: one choice of the HTTP request."""

    choice: Choice
    rid: str
    ids: list[int]
    sampling: SamplingParams
    pd: ImportParams | None  # decode role: the prefill candidates that push this choice's KV
    first_of_prompt: bool  # the prompt's usage (prompt and cached tokens) is counted once, from this child
    tracker: RequestTracker
    agen: Any = None
    started: bool = False
    finished: bool = False
    finish_reason: str | None = None


class Deadline:
    """Cancels the handler's task after `seconds`; `expired` tells a timeout apart from a client disconnect."""

    def __init__(self, seconds: float):
        self.expired = False
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_later(seconds, self._fire)

    def _fire(self) -> None:
        self.expired = True
        if self._task is not None:
            self._task.cancel()

    def swallow(self) -> None:
        """After catching the CancelledError this deadline caused, let the task run on normally."""
        if self._task is not None and hasattr(self._task, "uncancel"):
            self._task.uncancel()

    def cancel(self) -> None:
        self._handle.cancel()


def engine_error(e: BaseException) -> P.APIError | None:
    """The engine's admission failures as HTTP errors (None: not one of them)."""
    if isinstance(e, QueueFull):
        return P.overloaded(f"The server is overloaded: {e}", e.retry_after_s)
    if isinstance(e, EngineDead):
        return P.APIError(f"The engine is not running: {e}", 503, "server_error", None, "engine_dead")
    if isinstance(e, PromptTooLong):
        return P.context_length_exceeded(e)
    if isinstance(e, InvalidParameter):
        return P.bad_request(str(e), e.param)
    if isinstance(e, ValueError):  # the engine's own checks of a request (empty prompt, token id out of range, ...)
        return P.bad_request(str(e))
    return None


class _End:
    """A choice's engine stream ended (normally after its finished output)."""


_END = _End()


class Fanout:
    """The merged output streams of a request's children; one child is iterated directly (no task)."""

    def __init__(self, s: ServerState, children: list[Child]):
        self.s = s
        self.children = children
        self.remaining = len(children)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        for c in self.children:
            c.agen = self.s.llm.generate(c.rid, c.ids, c.sampling, kv=c.pd)
            self.s.admission.admitted(c.rid)
        if len(self.children) > 1:
            self._tasks = [asyncio.get_running_loop().create_task(self._pump(c)) for c in self.children]

    async def _pump(self, c: Child) -> None:
        try:
            async for out in c.agen:
                self._queue.put_nowait((c, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait((c, e))
        else:
            self._queue.put_nowait((c, _END))

    async def next(self) -> tuple[Child, RequestOutput]:
        """The next output of any unfinished child; raises what a child's stream raised."""
        while True:
            if len(self.children) == 1:
                c = self.children[0]
                try:
                    item: Any = await c.agen.__anext__()
                except StopAsyncIteration:
                    item = _END
            else:
                c, item = await self._queue.get()
            if item is _END:
                if not c.finished:
                    raise EngineDead("the engine ended a request without a final output")
                continue
            if isinstance(item, BaseException):
                raise item
            self._record(c, item)
            return c, item

    def _record(self, c: Child, out: RequestOutput) -> None:
        c.tracker.on_output(out)
        if not c.started:
            c.started = True
            self.s.admission.started(c.rid, len(c.ids), out)
        if out.finished and not c.finished:
            c.finished = True
            c.finish_reason = out.finish_reason
            self.remaining -= 1

    async def close(self) -> None:
        """Stop every pump, close every generator and abort every child that did not finish."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_TIMEOUT_S)
        for c in self.children:
            self.s.admission.done(c.rid)
            if not c.finished and c.agen is not None:
                await close_and_abort(self.s, c.agen, c.rid)


async def close_and_abort(s: ServerState, agen: Any, rid: str) -> None:
    """Close the engine's generator (which aborts the request) and abort explicitly in case it was never started."""
    try:
        await asyncio.wait_for(agen.aclose(), CLOSE_TIMEOUT_S)
    except Exception:
        log.warning("closing the output stream of %s failed", rid, exc_info=True)
    try:
        await asyncio.wait_for(s.llm.abort(rid), CLOSE_TIMEOUT_S)
    except Exception:
        log.warning("abort of %s failed", rid, exc_info=True)


def usage_of(children: list[Child]) -> dict:
    """Prompt (and cached) tokens once per prompt, completion tokens of every choice."""
    prompt = sum(c.tracker.prompt_tokens for c in children if c.first_of_prompt)
    cached = sum(c.tracker.cached_tokens for c in children if c.first_of_prompt)
    completion = sum(c.tracker.output_tokens for c in children)
    return P.usage(prompt, completion, cached)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def start_timeout_error(s: ServerState, start_s: float) -> P.APIError:
    """The 503 of an admitted request with no first output by its start deadline (`start_s` after it was admitted:
    the budget plus the allowance for its own prefill, Admission.start_deadline_s), which the message states."""
    budget = s.admission.budget_s
    return P.overloaded(f"The request could not start within {start_s:.2f} s (the server's {budget:g} s budget plus "
                        f"{start_s - budget:.2f} s for its own prefill); retry later", budget / 2, code="queue_timeout")


async def generate(request: web.Request, s: ServerState, req: P.GenerateRequest, children: list[Child],
                   fmt: OutputFormat) -> web.StreamResponse:
    """Run the children through the engine and answer, streamed or whole; always leaves the engine clean."""
    s.admission.check(len(children))  # again: tokenizing took time (the handler checked before it, too)
    fan = Fanout(s, children)
    deadline = Deadline(s.config.request_timeout_s)
    start_s = s.admission.start_deadline_s(max(len(c.ids) for c in children))
    outcome = "abort"
    try:
        fan.start()
        try:
            first = await (asyncio.wait_for(fan.next(), start_s) if start_s is not None else fan.next())
        except asyncio.TimeoutError:
            outcome = ""  # counted as rejected by the middleware
            raise start_timeout_error(s, start_s) from None
        except Exception as e:
            mapped = engine_error(e)
            if mapped is None:
                raise
            outcome = ""  # the middleware counts it as rejected/invalid
            raise mapped from e
        if req.stream:
            resp, outcome = await stream(request, req, fmt, fan, first, deadline)
            return resp
        outcome = await collect(fan, first)
        last = [c.choice.outs[-1] for c in children]
        errors = [o for o in last if o.finish_reason == "error"]
        if errors:
            outcome = "error"
            raise P.APIError(f"Generation failed: {errors[0].error or 'engine error'}", 500, "server_error")
        if any(o.finish_reason == "abort" for o in last):
            raise P.APIError("The request was aborted by the engine", 503, "server_error", code="aborted")
        body = fmt.response([c.choice for c in children], usage_of(children))
        timings = getattr(last[0], "pd_timings", None)
        if timings is not None:
            body["pd_timings"] = timings
        return web.json_response(body, headers={"X-Request-Id": fmt.rid}, dumps=_dumps)
    except asyncio.CancelledError:
        if not deadline.expired:
            raise  # the client went away
        deadline.swallow()
        outcome = "timeout"
        raise P.APIError(
            f"The request did not finish within {s.config.request_timeout_s:g} s", 504, "server_error", code="timeout"
        ) from None
    finally:
        deadline.cancel()
        await fan.close()
        if outcome:
            for c in children:
                c.tracker.finish(c.finish_reason or outcome)


async def collect(fan: Fanout, first: tuple[Child, RequestOutput]) -> str:
    """Whole response: gather every child's outputs; returns the outcome for the metrics."""
    c, out = first
    c.choice.outs.append(out)
    while fan.remaining:
        try:
            c, out = await fan.next()
        except EngineDead as e:  # the engine died under the request
            raise P.APIError(f"The engine stopped during the request: {e}", 503, "server_error") from None
        c.choice.outs.append(out)
    reasons = [ch.finish_reason for ch in fan.children]
    return next((r for r in reasons if r in ("error", "abort")), reasons[0] or "stop")


async def stream(
    request: web.Request,
    req: P.GenerateRequest,
    fmt: OutputFormat,
    fan: Fanout,
    first: tuple[Child, RequestOutput],
    deadline: Deadline,
) -> tuple[web.StreamResponse, str]:
    """Write server-sent events until every choice finishes; returns (response, outcome)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": fmt.rid}
    )
    await resp.prepare(request)
    null_usage = req.include_usage and not req.continuous_usage
    children = fan.children

    def event(chunk: dict) -> bytes:
        if req.continuous_usage and req.include_usage:
            chunk["usage"] = usage_of(children)
        elif null_usage:
            chunk["usage"] = None
        return P.sse(chunk)

    outcome = "abort"
    try:
        buf = b"".join(event(ch) for c in sorted(children, key=lambda c: c.choice.index)
                       for ch in fmt.start_chunks(c.choice))
        c, out = first
        while True:
            buf += b"".join(event(ch) for ch in fmt.delta_chunks(c.choice, out))
            if out.finished:
                if out.finish_reason == "error":
                    outcome = "error"
                    buf += P.sse(P.error_body(f"Generation failed: {out.error or 'engine error'}", "server_error"))
                    buf += P.SSE_DONE
                    await resp.write(buf)
                    break
                buf += event(fmt.finish_chunk(c.choice, out.finish_reason))
                if not fan.remaining:
                    outcome = out.finish_reason or "stop"
                    if req.include_usage:
                        chunk = P.usage_chunk(fmt.rid, fmt.created, fmt.model, fmt.chunk_object, usage_of(children))
                        timings = getattr(out, "pd_timings", None)
                        if timings is not None:  # the router strips it
                            chunk["pd_timings"] = timings
                        buf += P.sse(chunk)
                    buf += P.SSE_DONE
                    await resp.write(buf)
                    break
            if buf:
                await resp.write(buf)
                buf = b""
            c, out = await fan.next()
    except asyncio.CancelledError:
        if not deadline.expired:
            raise
        deadline.swallow()
        outcome = "timeout"
        await _write_quietly(resp, P.sse(P.error_body("The request timed out", "server_error", code="timeout")))
    except (ConnectionResetError, BrokenPipeError):
        pass  # the client went away; the caller aborts the request
    except Exception as e:  # an engine failure mid-stream: headers are sent, so report it in the stream
        log.exception("stream %s failed", fmt.rid)
        outcome = "error"
        body = P.error_body(f"Generation failed: {type(e).__name__}: {e}", "server_error")
        await _write_quietly(resp, P.sse(body) + P.SSE_DONE)
    return resp, outcome


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionResetError, BrokenPipeError, RuntimeError):
        pass

"""POST /v1/completions and /v1/chat/completions: tokenize off the event loop, stream the engine's deltas.

Why the care with closing: a request whose client went away must give its KV blocks back. aiohttp cancels the
handler when the peer disconnects (the runner is started with handler_cancellation=True) and a write to a closed
stream raises; either way the `finally` below closes the engine's generator and aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from pdserve import protocol as P
from pdserve.engine.errors import EngineDead, PromptTooLong, QueueFull
from pdserve.engine.messages import import_params
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import InvalidParameter
from pdserve.server.app import ServerState, state
from pdserve.server.formats import ChatFormat, CompletionFormat, OutputFormat

log = logging.getLogger("pdserve.server")


async def read_json(request: web.Request) -> Any:
    raw = await request.read()  # over client_max_size: HTTP 413, mapped by the middleware
    if not raw:
        raise P.bad_request("The request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise P.bad_request(f"The request body is not valid JSON: {e}") from e


def check_model(s: ServerState, model: str | None) -> None:
    if model is not None and model not in (s.model_name, s.config.engine.model):
        raise P.model_not_found(model)


def check_token_ids(ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise P.bad_request(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")


def vocab_size(llm: Any) -> int | None:
    """The largest valid token id + 1: the model's vocabulary where the engine reports it, else the tokenizer's."""
    sizes = [getattr(llm, "info", {}).get("vocab_size"), getattr(llm.tokenizer, "vocab_size", None)]
    sizes = [n for n in sizes if isinstance(n, int) and n > 0]
    return min(sizes) if sizes else None


async def completions(request: web.Request) -> web.StreamResponse:
    s = state(request)
    req = P.parse_completion(await read_json(request))
    check_model(s, req.model)
    tok = s.llm.tokenizer
    if isinstance(req.prompt, str):
        ids = list(await asyncio.to_thread(tok.encode, req.prompt))
        echo_text = req.prompt
    else:
        ids = req.prompt
        check_token_ids(ids, vocab_size(s.llm))
        echo_text = await asyncio.to_thread(tok.decode, ids) if req.echo else ""
    if not ids:
        raise P.bad_request("prompt must not be empty", "prompt")
    fmt = CompletionFormat(P.new_id("cmpl"), s.model_name, tok, echo_text if req.echo else "", req.sampling.logprobs)
    return await generate(request, s, req, ids, fmt)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    s = state(request)
    req = P.parse_chat(await read_json(request))
    check_model(s, req.model)
    tok = s.llm.tokenizer
    try:
        ids = list(
            await asyncio.to_thread(tok.encode_chat, req.messages, add_generation_prompt=req.add_generation_prompt)
        )
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise P.bad_request(f"messages could not be rendered with the model's chat template: {e}", "messages") from e
    except Exception as e:  # jinja2's TemplateError from the template's raise_exception, without importing jinja2
        if type(e).__module__.startswith("jinja2"):
            raise P.bad_request(f"messages rejected by the model's chat template: {e}", "messages") from e
        raise
    fmt = ChatFormat(P.new_id("chatcmpl"), s.model_name, tok, req.logprobs)
    return await generate(request, s, req, ids, fmt)


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


def engine_error(e: Exception) -> P.APIError | None:
    """The engine's admission failures as HTTP errors (None: not one of them)."""
    if isinstance(e, QueueFull):
        retry = str(max(1, int(e.retry_after_s)))
        return P.APIError(
            f"The server is overloaded: {e}", 503, "server_error", None, "queue_full", {"Retry-After": retry}
        )
    if isinstance(e, EngineDead):
        return P.APIError(f"The engine is not running: {e}", 503, "server_error", None, "engine_dead")
    if isinstance(e, PromptTooLong):
        return P.context_length_exceeded(e.num_tokens, e.max_tokens, e.max_model_len)
    if isinstance(e, InvalidParameter):
        return P.bad_request(str(e), e.param)
    if isinstance(e, ValueError):  # the engine's own checks of a request (empty prompt, token id out of range, ...)
        return P.bad_request(str(e))
    return None


async def generate(
    request: web.Request, s: ServerState, req: P.GenerateRequest, ids: list[int], fmt: OutputFormat
) -> web.StreamResponse:
    """Run one request through the engine and answer it, streamed or whole; always leaves the engine clean."""
    P.resolve_max_tokens(req, len(ids), s.llm.max_model_len)
    tracker = s.metrics.track()
    tracker.prompt_tokens = len(ids)
    try:
        kv = import_params(req.pd)
    except ValueError as e:
        raise P.bad_request(str(e), "pd") from e
    agen: AsyncIterator[RequestOutput] = s.llm.generate(fmt.rid, ids, req.sampling, kv=kv)
    deadline = Deadline(s.config.request_timeout_s)
    finished = False
    outcome = "abort"
    try:
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            raise P.APIError("The engine ended the request without output", 500, "server_error") from None
        except Exception as e:
            mapped = engine_error(e)
            if mapped is None:
                raise
            outcome = ""  # the middleware counts it as rejected/invalid
            raise mapped from e
        tracker.on_output(first)
        finished = first.finished
        if req.stream:
            resp, finished, outcome = await stream(request, req, fmt, first, agen, tracker, deadline)
            return resp
        outs = [first]
        while not finished:
            try:
                out = await agen.__anext__()
            except (EngineDead, StopAsyncIteration) as e:  # the engine died under the request
                outcome = "error"
                raise P.APIError(f"The engine stopped during the request: {e}", 503, "server_error") from None
            tracker.on_output(out)
            outs.append(out)
            finished = out.finished
        last = outs[-1]
        outcome = last.finish_reason or "stop"
        if last.finish_reason == "error":
            raise P.APIError(f"Generation failed: {last.error or 'engine error'}", 500, "server_error")
        if last.finish_reason == "abort":
            raise P.APIError("The request was aborted by the engine", 503, "server_error", code="aborted")
        body = fmt.response(outs, P.usage(tracker.prompt_tokens, tracker.output_tokens, tracker.cached_tokens))
        if getattr(last, "pd_timings", None) is not None:
            body["pd_timings"] = last.pd_timings
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
        if outcome:
            tracker.finish(outcome)
        if not finished:
            await close_and_abort(s, agen, fmt.rid)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


async def close_and_abort(s: ServerState, agen: Any, rid: str) -> None:
    """Close the engine's generator (which aborts the request) and abort explicitly in case it was never started."""
    try:
        await agen.aclose()
    except Exception:
        log.warning("closing the output stream of %s failed", rid, exc_info=True)
    try:
        await s.llm.abort(rid)
    except Exception:
        log.warning("abort of %s failed", rid, exc_info=True)


async def stream(
    request: web.Request,
    req: P.GenerateRequest,
    fmt: OutputFormat,
    first: RequestOutput,
    agen: AsyncIterator[RequestOutput],
    tracker: Any,
    deadline: Deadline,
) -> tuple[web.StreamResponse, bool, str]:
    """Write server-sent events until the request finishes; returns (response, finished, outcome)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": fmt.rid}
    )
    await resp.prepare(request)
    null_usage = req.include_usage and not req.continuous_usage

    def usage() -> dict:
        return P.usage(tracker.prompt_tokens, tracker.output_tokens, tracker.cached_tokens)

    def event(chunk: dict) -> bytes:
        if req.continuous_usage and req.include_usage:
            chunk["usage"] = usage()
        elif null_usage:
            chunk["usage"] = None
        return P.sse(chunk)

    finished, outcome = False, "abort"
    try:
        buf = b"".join(event(c) for c in fmt.start_chunks())
        out = first
        while True:
            buf += b"".join(event(c) for c in fmt.delta_chunks(out))
            if out.finished:
                finished = True
                outcome = out.finish_reason or "stop"
                if out.finish_reason == "error":
                    err = P.error_body(f"Generation failed: {out.error or 'engine error'}", "server_error")
                    buf += P.sse(err)
                else:
                    buf += event(fmt.finish_chunk(out.finish_reason))
                    if req.include_usage:
                        chunk = P.usage_chunk(fmt.rid, fmt.created, fmt.model, fmt.chunk_object, usage())
                        if getattr(out, "pd_timings", None) is not None:  # the router strips it
                            chunk["pd_timings"] = out.pd_timings
                        buf += P.sse(chunk)
                buf += P.SSE_DONE
                await resp.write(buf)
                break
            if buf:
                await resp.write(buf)
                buf = b""
            out = await agen.__anext__()
            tracker.on_output(out)
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
    return resp, finished, outcome


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionResetError, BrokenPipeError, RuntimeError):
        pass

"""One streaming request against an OpenAI-compatible endpoint, timed chunk by chunk (vLLM's definitions).

TTFT is the time to the first chunk carrying content; ITL the gaps between successive content chunks; the
output token count comes from the server's `usage` (asked for with stream_options.include_usage) and falls
back to the benchmark tokenizer, then to the number of content chunks. Anything unexpected (HTTP errors,
malformed SSE events, error objects in the stream, a stream cut before `data: [DONE]`) ends the request as a
failure with a short kind and a message: it never raises out of `send_request`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.tokenizer import BenchTokenizer

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass
class RequestResult:
    """Everything measured about one request; times are seconds (`start` on the time.perf_counter clock)."""

    index: int
    prompt_len: int = -1
    output_len: int = 0  # tokens asked for
    success: bool = False
    error_kind: str = ""
    error: str = ""
    start: float = 0.0
    first_token_time: float = 0.0  # absolute perf_counter time of the first content chunk, 0 until it arrives
    ttft: float = 0.0
    latency: float = 0.0  # end-to-end
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    server_completion_tokens: int | None = None
    generated_text: str = ""
    done: bool = False

    def fail(self, kind: str, message: str) -> None:
        self.success, self.error_kind, self.error = False, kind, message[:500]
        if self.start and not self.latency:
            self.latency = time.perf_counter() - self.start


@dataclass
class EndpointConfig:
    base_url: str
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str = ""
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    request_timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT):
            raise ValueError(f"--endpoint must be {COMPLETIONS_ENDPOINT} or {CHAT_ENDPOINT}, got {self.endpoint!r}")
        self.base_url = self.base_url.rstrip("/")

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint


def build_payload(cfg: EndpointConfig, req: BenchRequest) -> dict:
    body: dict = {
        "model": cfg.model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.chat:
        body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
    else:
        if req.prompt is None:
            raise ValueError("chat-message requests need --endpoint /v1/chat/completions")
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _content_of(event: dict, chat: bool) -> str:
    choices = event.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ValueError("choice is not an object")
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise ValueError("choices[0].text is not a string")
    return text or ""


class _StreamError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _handle_event(res: RequestResult, data: str, chat: bool, now: float, parts: list[str], last: list[float]) -> bool:
    """Apply one SSE data payload; True when it was the [DONE] sentinel."""
    if data == "[DONE]":
        return True
    try:
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError("event is not a JSON object")
        if "error" in event:
            err = event["error"]
            raise _StreamError("stream_error", f"error event: {json.dumps(err)[:300]}")
        content = _content_of(event, chat)
    except (ValueError, AttributeError, TypeError) as e:
        raise _StreamError("malformed_sse", f"malformed SSE event ({e}): {data[:200]!r}") from None
    usage = event.get("usage")
    if isinstance(usage, dict):
        res.server_prompt_tokens = usage.get("prompt_tokens", res.server_prompt_tokens)
        res.server_completion_tokens = usage.get("completion_tokens", res.server_completion_tokens)
    if content:
        if res.num_chunks == 0:
            res.first_token_time = now
            res.ttft = now - res.start
        else:
            res.itl.append(now - last[0])
        last[0] = now
        res.num_chunks += 1
        parts.append(content)
    return False


async def send_request(
    session: aiohttp.ClientSession,
    cfg: EndpointConfig,
    req: BenchRequest,
    res: RequestResult,
    tok: BenchTokenizer | None = None,
) -> RequestResult:
    """Send `req`, filling `res` live (so a watcher can see first-token times of requests still in flight)."""
    res.prompt_len, res.output_len = req.prompt_len, req.output_len
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    parts: list[str] = []
    last = [0.0]
    try:
        payload = build_payload(cfg, req)
    except ValueError as e:
        res.fail("bad_request", str(e))
        return res
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    res.start = time.perf_counter()
    try:
        async with session.post(cfg.url, json=payload, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                raise _StreamError(f"http_{resp.status}", f"HTTP {resp.status}: {body}")
            buf, event_lines, got_done = b"", [], False
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
                    if line.startswith("data:"):
                        event_lines.append(line[5:].lstrip(" "))
                    elif line == "" and event_lines:
                        data, event_lines = "\n".join(event_lines), []
                        if _handle_event(res, data, cfg.chat, now, parts, last):
                            got_done = True
                    # comments (":") and other SSE fields (event:, id:, retry:) carry nothing we time
            if event_lines and not got_done:  # last event without its blank line
                got_done = _handle_event(res, "\n".join(event_lines), cfg.chat, time.perf_counter(), parts, last)
            res.latency = time.perf_counter() - res.start
            if not got_done:
                raise _StreamError("incomplete_stream", "stream ended before data: [DONE]")
            if res.num_chunks == 0:
                raise _StreamError("empty_output", "the stream carried no generated text")
    except _StreamError as e:
        res.generated_text = "".join(parts)
        res.fail(e.kind, str(e))
        return res
    except asyncio.TimeoutError:
        res.fail("timeout", f"no complete response within {cfg.request_timeout_s:g} s")
        return res
    except aiohttp.ClientError as e:
        res.fail("connection", f"{type(e).__name__}: {e}")
        return res
    res.generated_text = "".join(parts)
    if res.server_completion_tokens is not None:
        res.output_tokens = int(res.server_completion_tokens)
    elif tok is not None:
        res.output_tokens = tok.count(res.generated_text)
    else:
        res.output_tokens = res.num_chunks
    res.success = True
    return res

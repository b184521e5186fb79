"""One streaming request against an OpenAI-compatible endpoint, timed chunk by chunk with vLLM's definitions.

As vLLM 0.22's `bench serve` does: every streamed event whose `choices` is non-empty gets a timestamp, also when
its text is empty (a special token, a token whose text the detokenizer holds back). TTFT is the first such
timestamp minus the send time, ITL the gaps between successive ones, and E2EL ends at the last one: not at
`data: [DONE]`, not at a trailing usage-only event. Output tokens are `usage.completion_tokens` when the server
reports them (asked for with stream_options.include_usage), else the benchmark tokenizer's count of the
generated text, else (no tokenizer) the number of timed events; input tokens are `usage.prompt_tokens` when
given, else the dataset's prompt length.

pdserve is stricter than vLLM about what counts as a success: anything unexpected (HTTP errors, malformed SSE
events, error objects in the stream, a stream cut before `data: [DONE]`) ends the request as a failure with a
short kind and a message. `send_request` never raises.
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
BACKENDS = {"openai": COMPLETIONS_ENDPOINT, "vllm": COMPLETIONS_ENDPOINT, "openai-chat": CHAT_ENDPOINT}


@dataclass
class RequestResult:
    """Everything measured about one request; times are seconds on the time.perf_counter clock."""

    index: int
    request_id: str | None = None
    prompt_len: int = -1  # tokens of the dataset's prompt under the benchmark tokenizer; -1 when unknown
    output_len: int = 0  # tokens asked for
    success: bool = False
    error_kind: str = ""
    error: str = ""
    arrival: float = 0.0  # when the request was due (before waiting for a concurrency slot)
    start: float = 0.0  # when it was sent
    first_token_time: float = 0.0  # absolute time of the first timed event, 0 until it arrives
    ttft: float = 0.0
    latency: float = 0.0  # end-to-end: send to the last timed event
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0  # timed events: those with non-empty choices
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    server_completion_tokens: int | None = None
    generated_text: str = ""
    done: bool = False

    @property
    def input_tokens(self) -> int:
        """The server's prompt token count when it reported one, else the dataset's (vLLM's rule)."""
        if self.server_prompt_tokens is not None:
            return int(self.server_prompt_tokens)
        return max(self.prompt_len, 0)

    @property
    def queue_time(self) -> float:
        """Time spent waiting for a concurrency slot in the client."""
        return max(self.start - self.arrival, 0.0) if self.start and self.arrival else 0.0

    def fail(self, kind: str, message: str) -> None:
        self.success, self.error_kind, self.error = False, kind, message[:500]
        if self.start and not self.latency:
            self.latency = time.perf_counter() - self.start


@dataclass
class EndpointConfig:
    base_url: str
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str = ""  # the name sent in requests (vLLM's --served-model-name, else --model, else /v1/models)
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)  # temperature, top_p, ... as given; nothing sent when absent
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    logprobs: int | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None
    # aiohttp's trust_env, which vLLM's `bench serve` sets: proxies from HTTP(S)_PROXY/NO_PROXY and credentials from
    # .netrc, looked up per request. aiohttp 3.14 does both lookups in the default thread pool, so 256 requests
    # started at once reach the server ~200 ms later than without it (benchmarks/lease_s11/client_intake), and at 16
    # Poisson requests/s each request ~2-5 ms later (lease_s18/client_poisson); every TTFT includes that wait. On by
    # default, as vLLM's client has it: the environment's proxies are honoured and the two clients read the same TTFT
    # (lease_s18); off (--no-trust-env), the TTFT is closer to the server's own.
    trust_env: bool = True

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
    body: dict = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.chat:
        body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        if req.prompt is None:
            raise ValueError("chat-message requests need --endpoint /v1/chat/completions")
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
        if cfg.logprobs is not None:
            body["logprobs"] = cfg.logprobs
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.sampling)
    body.update(cfg.extra_body)
    return body


def build_headers(cfg: EndpointConfig, request_id: str | None) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    headers.update(cfg.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return headers


def _choice_text(choices: list, chat: bool) -> str:
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ValueError("choice is not an object")
    if chat:
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise ValueError("choices[0].delta is not an object")
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    else:
        text = choice.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError("choices[0].text is not a string")
    return text or ""


class _StreamError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def handle_event(res: RequestResult, data: str, chat: bool, now: float, parts: list[str]) -> bool:
    """Apply one SSE data payload received at `now`; True when it was the [DONE] sentinel."""
    if data == "[DONE]":
        return True
    try:
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError("event is not a JSON object")
        if "error" in event:
            raise _StreamError("stream_error", f"error event: {json.dumps(event['error'])[:300]}")
        choices = event.get("choices")
        if choices is not None and not isinstance(choices, list):
            raise ValueError("choices is not a list")
        text = _choice_text(choices, chat) if choices else None
    except (ValueError, AttributeError, TypeError) as e:
        raise _StreamError("malformed_sse", f"malformed SSE event ({e}): {data[:200]!r}") from None
    usage = event.get("usage")
    if isinstance(usage, dict):
        if usage.get("prompt_tokens") is not None:
            res.server_prompt_tokens = usage["prompt_tokens"]
        if usage.get("completion_tokens") is not None:
            res.server_completion_tokens = usage["completion_tokens"]
    if text is not None:  # an event with choices: timed even when its text is empty
        if res.num_chunks == 0:
            res.first_token_time = now
            res.ttft = now - res.start
        else:  # res.latency still ends at the previous timed event
            res.itl.append(now - (res.start + res.latency))
        res.latency = now - res.start
        res.num_chunks += 1
        parts.append(text)
    return False


def count_output_tokens(res: RequestResult, tok: BenchTokenizer | None) -> int:
    """usage.completion_tokens when reported (and non-zero, as vLLM reads it), else the tokenizer's count."""
    if res.server_completion_tokens:
        return int(res.server_completion_tokens)
    if tok is not None:
        return tok.count(res.generated_text)
    return res.num_chunks


async def send_request(
    session: aiohttp.ClientSession,
    cfg: EndpointConfig,
    req: BenchRequest,
    res: RequestResult,
    tok: BenchTokenizer | None = None,
) -> RequestResult:
    """Send `req`, filling `res` live (so a watcher can see first-token times of requests still in flight)."""
    res.prompt_len, res.output_len = req.prompt_len, req.output_len
    parts: list[str] = []
    try:
        payload = build_payload(cfg, req)
    except ValueError as e:
        res.fail("bad_request", str(e))
        return res
    headers = build_headers(cfg, res.request_id)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    res.start = time.perf_counter()
    try:
        async with session.post(cfg.url, json=payload, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                raise _StreamError(f"http_{resp.status}", f"HTTP {resp.status} {resp.reason or ''}: {body}")
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
                        if handle_event(res, data, cfg.chat, now, parts):
                            got_done = True
                    # comments (":") and other SSE fields (event:, id:, retry:) carry nothing we time
            if buf.startswith(b"data:"):  # a last line without its newline
                event_lines.append(buf[5:].decode("utf-8", errors="replace").strip())
            if event_lines and not got_done:  # last event without its blank line
                got_done = handle_event(res, "\n".join(event_lines), cfg.chat, time.perf_counter(), parts)
            if not got_done:
                raise _StreamError("incomplete_stream", "stream ended before data: [DONE]")
            if res.num_chunks == 0:
                raise _StreamError("empty_output", "the stream carried no event with choices (no TTFT)")
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
    res.output_tokens = count_output_tokens(res, tok)
    res.success = True
    return res

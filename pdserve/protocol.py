"""OpenAI request parsing and response shapes, as pure functions with no I/O.

Why one module: the instance server and the router both speak this dialect, and a request is validated once,
at the door, into a `SamplingParams` the engine can trust. Every rejection is an `APIError` carrying the HTTP
status and OpenAI's error body, so no bad input reaches the engine or turns into a 500 with a stack trace.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling_params import InvalidParameter, SamplingParams

MAX_LOGPROBS = 20  # SamplingParams accepts top-k logprobs up to this many

# ----------------------------------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """A request that cannot be served, with the HTTP status and the fields of OpenAI's error object."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, "invalid_request_error", "model", "model_not_found")


def context_length_exceeded(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str = "prompt"
) -> APIError:
    """400 naming both numbers, worded like OpenAI's so clients that parse it keep working."""
    if max_tokens is None or prompt_tokens >= max_model_len:
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length of the prompt."
        )
    else:
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or the completion."
        )
    return APIError(msg, 400, "invalid_request_error", param, "context_length_exceeded")


# ----------------------------------------------------------------------------------------------------------------
# typed field access: JSON has no ints vs bools distinction in Python (True is an int), so check explicitly


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"{name} must be {what}, got {json.dumps(value)}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"{name} must be {what}, got {json.dumps(value)[:100]}", name)
    return value


def _int(body: dict, name: str, default: int | None = None) -> int | None:
    return _get(body, name, (int,), "an integer", default)


def _num(body: dict, name: str, default: float | None = None) -> float | None:
    return _get(body, name, (int, float), "a number", default)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    return _get(body, name, (bool,), "a boolean", default)


def _str_list(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise bad_request(f"{name} must be a string or a list of strings", name)


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise bad_request(f"{name} must be a list of integers", name)


def _unsupported_if(cond: bool, name: str, what: str) -> None:
    if cond:
        raise bad_request(f"{name}: {what} is not supported by pdserve", name)


# ----------------------------------------------------------------------------------------------------------------
# requests


@dataclass
class GenerateRequest:
    """What both endpoints reduce to; the handler adds the prompt's token ids."""

    model: str | None
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens_given: bool = True  # False: fill max_tokens up to the context length once the prompt is tokenized
    pd: dict | None = None


@dataclass
class CompletionRequest(GenerateRequest):
    prompt: str | list[int] = ""
    echo: bool = False


@dataclass
class ChatRequest(GenerateRequest):
    messages: list[dict[str, str]] = field(default_factory=list)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int = 0


def _common(body: Any, max_tokens: int | None, default_max_tokens: int | None) -> dict[str, Any]:
    """Fields both endpoints share; returns keyword arguments for GenerateRequest."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    n = _int(body, "n", 1)
    if n != 1:
        raise bad_request(f"n must be 1 (pdserve generates one choice per request), got {n}", "n")
    best_of = _int(body, "best_of", None)
    _unsupported_if(best_of not in (None, 1), "best_of", "best_of > 1")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        value = _num(body, name, neutral)
        _unsupported_if(value != neutral, name, f"a {name} other than {neutral}")
    logit_bias = body.get("logit_bias")
    _unsupported_if(bool(logit_bias), "logit_bias", "logit_bias")
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = continuous = False
    if stream_options is not None:
        if not stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        if not isinstance(stream_options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        include_usage = _bool(stream_options, "include_usage", False)
        continuous = _bool(stream_options, "continuous_usage_stats", False)
    pd = body.get("pd")
    if pd is not None and not isinstance(pd, dict):
        raise bad_request("pd must be an object", "pd")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=_num(body, "temperature", 1.0),
            top_p=_num(body, "top_p", 1.0),
            top_k=_int(body, "top_k", -1),
            min_p=_num(body, "min_p", 0.0),
            seed=_int(body, "seed", None),
            stop=_str_list(body, "stop"),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            ignore_eos=_bool(body, "ignore_eos", False),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
            min_tokens=_int(body, "min_tokens", 0),
        )
    except InvalidParameter as e:
        raise bad_request(str(e), e.param) from e
    return dict(
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens_given=max_tokens is not None,
        pd=pd,
    )


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


def _set_logprobs(sampling: SamplingParams, k: int | None, param: str) -> None:
    sampling.logprobs = k
    try:
        sampling.validate()
    except InvalidParameter as e:
        raise bad_request(str(e).replace("logprobs", param, 1), param) from e


def parse_completion(body: Any) -> CompletionRequest:
    """POST /v1/completions body -> CompletionRequest (raises APIError with status 400)."""
    body = _require_object(body)
    if "prompt" not in body:
        raise bad_request("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("batch prompts are not supported: send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("prompt must be a string or a list of token ids", "prompt")
    elif not isinstance(prompt, str):
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    _unsupported_if(body.get("suffix") is not None, "suffix", "suffix")
    common = _common(body, _int(body, "max_tokens", None), SamplingParams().max_tokens)
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None)
    _unsupported_if(echo and logprobs is not None, "echo", "echo together with logprobs (prompt logprobs)")
    if logprobs is not None:
        _set_logprobs(common["sampling"], logprobs, "logprobs")
    return CompletionRequest(prompt=prompt, echo=echo, **common)


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{index}].content: only text parts are supported, got {kind!r}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any) -> ChatRequest:
    """POST /v1/chat/completions body -> ChatRequest (raises APIError with status 400)."""
    body = _require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        if m["role"] not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m['role']!r}", "messages"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        parsed.append({"role": role, "content": _message_text(m.get("content"), i)})
    _unsupported_if(bool(body.get("tools")) or bool(body.get("functions")), "tools", "tool calling")
    fmt = body.get("response_format")
    _unsupported_if(fmt is not None and fmt != {"type": "text"}, "response_format", "a response_format other than text")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    common = _common(body, max_tokens, None)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if logprobs:
        _set_logprobs(common["sampling"], top or 0, "top_logprobs")
    return ChatRequest(
        messages=parsed,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        logprobs=logprobs,
        top_logprobs=top or 0,
        **common,
    )


def resolve_max_tokens(req: GenerateRequest, prompt_tokens: int, max_model_len: int) -> None:
    """Check the prompt against the context length and fill in max_tokens when the client left it open."""
    given = req.sampling.max_tokens if req.max_tokens_given else None
    if prompt_tokens >= max_model_len or (given is not None and prompt_tokens + given > max_model_len):
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        raise context_length_exceeded(prompt_tokens, given, max_model_len, param)
    if req.sampling.max_tokens is None or not req.max_tokens_given:
        default = req.sampling.max_tokens
        room = max_model_len - prompt_tokens
        req.sampling.max_tokens = room if default is None else min(default, room)


# ----------------------------------------------------------------------------------------------------------------
# responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


TokenText = Callable[[int], str]


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset).

    Why stateful: text_offset counts characters from the start of the whole completion, across stream chunks.
    """

    def __init__(self, token_text: TokenText, offset: int = 0):
        self.token_text = token_text
        self.offset = offset

    def chunk(self, entries) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.token_text(e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.token_text(t): lp for t, lp in e.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(entries, token_text: TokenText) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


def completion_response(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, logprobs, usage_: dict
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, logprobs=None, usage_=None
) -> dict[str, Any]:
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_response(
    rid: str, created: int, model: str, content: str, finish_reason: str | None, logprobs, usage_: dict
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict, finish_reason: str | None, logprobs=None, usage_=None
) -> dict[str, Any]:
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: empty choices, usage filled."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <compact JSON>\\n\\n` (or the literal `[DONE]`)."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")

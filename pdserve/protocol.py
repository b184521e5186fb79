"""OpenAI request parsing and response shapes, as pure functions with no I/O.

Why one module: the instance server and the router both speak this dialect, and a request is validated once,
at the door, into `SamplingParams` the engine can trust. Every rejection is an `APIError` carrying the HTTP
status and OpenAI's error body, so no bad input reaches the engine or turns into a 500 with a stack trace.
Unknown fields are ignored, as vLLM and OpenAI do; fields pdserve cannot honour are refused by name.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import PromptTooLong
from pdserve.sampling_params import InvalidParameter, SamplingParams
from pdserve.validation import INT64_MAX, INT64_MIN, check_prompt_len

DEFAULT_MAX_CHOICES = 128  # n x number of prompts of one request, unless the server says otherwise

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


def overloaded(message: str, retry_after_s: float, code: str = "queue_full") -> APIError:
    """503 with Retry-After (whole seconds, at least 1)."""
    retry = str(max(1, int(retry_after_s + 0.999)))
    return APIError(message, 503, "server_error", None, code, {"Retry-After": retry})


def context_length_exceeded(e: PromptTooLong, param: str = "prompt") -> APIError:
    """400 naming both numbers; the wording lives in PromptTooLong (shared with the engine)."""
    return APIError(str(e), 400, "invalid_request_error", param, "context_length_exceeded")


def from_invalid(e: InvalidParameter) -> APIError:
    return bad_request(str(e), e.param)


# ----------------------------------------------------------------------------------------------------------------
# typed field access: JSON has no ints vs bools distinction in Python (True is an int), so check explicitly


def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:100]
    except (TypeError, ValueError):
        return repr(value)[:100]


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"{name} must be {what}, got {_show(value)}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"{name} must be {what}, got {_show(value)}", name)
    return value


def _int(body: dict, name: str, default: int | None = None) -> int | None:
    value = _get(body, name, (int,), "an integer", default)
    if value is not None and not INT64_MIN <= value <= INT64_MAX:
        raise bad_request(f"{name} must fit in a 64-bit signed integer, got {_show(value)}", name)
    return value


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


def _is_ids(value: Any) -> bool:
    """A list of ints (no bools), tested in C: a 32k-id prompt in well under a millisecond."""
    return isinstance(value, list) and (not value or set(map(type, value)) == {int})


def _int_list(body: dict, name: str, default: list[int] | None = None) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return default
    if _is_ids(value):
        return list(value)
    raise bad_request(f"{name} must be a list of integers", name)


def _unsupported_if(cond: bool, name: str, what: str) -> None:
    if cond:
        raise bad_request(f"{name}: {what} is not supported by pdserve", name)


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


# ----------------------------------------------------------------------------------------------------------------
# generation requests


@dataclass
class GenerateRequest:
    """What both endpoints reduce to; the handler adds the prompts' token ids."""

    model: str | None
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens_given: bool = True  # False: fill max_tokens up to the context length once the prompt is tokenized
    pd: dict | None = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"


Prompt = str | list[int]


@dataclass
class CompletionRequest(GenerateRequest):
    prompts: list[Prompt] = field(default_factory=list)  # one or more; choice index = prompt index * n + i
    echo: bool = False


@dataclass
class ChatRequest(GenerateRequest):
    messages: list[dict[str, str]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def _common(body: dict, max_tokens: int | None, default_max_tokens: int | None, num_prompts: int,
            max_choices: int) -> dict[str, Any]:
    """Fields both endpoints share; returns keyword arguments for GenerateRequest."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    n = _int(body, "n", 1)
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    if n * num_prompts > max_choices:
        raise bad_request(f"n ({n}) times the number of prompts ({num_prompts}) must be at most {max_choices}", "n")
    best_of = _int(body, "best_of", None)
    _unsupported_if(best_of not in (None, n), "best_of", "best_of other than n")
    _unsupported_if(bool(body.get("use_beam_search")), "use_beam_search", "beam search")
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
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=_num(body, "temperature", 1.0),
            top_p=_num(body, "top_p", 1.0),
            top_k=_int(body, "top_k", -1),
            min_p=_num(body, "min_p", 0.0),
            seed=_int(body, "seed", None),
            stop=_str_list(body, "stop"),
            stop_token_ids=_int_list(body, "stop_token_ids", []),
            ignore_eos=_bool(body, "ignore_eos", False),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
            min_tokens=_int(body, "min_tokens", 0),
            presence_penalty=_num(body, "presence_penalty", 0.0),
            frequency_penalty=_num(body, "frequency_penalty", 0.0),
            repetition_penalty=_num(body, "repetition_penalty", 1.0),
            logit_bias=logit_bias or None,
            allowed_token_ids=_int_list(body, "allowed_token_ids", None),
        )
    except InvalidParameter as e:
        raise from_invalid(e) from e
    if n > 1 and sampling.temperature < 1e-5:  # as vLLM: n identical greedy choices are a client mistake
        raise bad_request(f"n must be 1 when using greedy sampling, got {n}", "n")
    return dict(
        model=model,
        sampling=sampling,
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens_given=max_tokens is not None,
        pd=pd,
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False),
    )


def _set_logprobs(sampling: SamplingParams, k: int | None, param: str) -> None:
    sampling.logprobs = k
    try:
        sampling.validate()
    except InvalidParameter as e:
        raise bad_request(str(e).replace("logprobs", param, 1), param) from e


def _prompts(prompt: Any) -> list[Prompt]:
    """A string, a list of token ids, a list of strings, or a list of token-id lists -> the list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            for i, p in enumerate(prompt):
                if not p:
                    raise bad_request(f"prompt[{i}] must not be empty", "prompt")
                if not _is_ids(p):
                    raise bad_request(f"prompt[{i}] must be a list of token ids", "prompt")
            return [list(p) for p in prompt]
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    raise bad_request(
        "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists", "prompt"
    )


def parse_completion(body: Any, max_choices: int = DEFAULT_MAX_CHOICES) -> CompletionRequest:
    """POST /v1/completions body -> CompletionRequest (raises APIError with status 400)."""
    body = _require_object(body)
    if body.get("prompt") is None:
        raise bad_request("prompt is required", "prompt")
    prompts = _prompts(body["prompt"])
    _unsupported_if(body.get("suffix") is not None, "suffix", "suffix")
    _unsupported_if(body.get("prompt_embeds") is not None, "prompt_embeds", "prompt_embeds")
    common = _common(body, _int(body, "max_tokens", None), SamplingParams().max_tokens, len(prompts), max_choices)
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None)
    _unsupported_if(echo and logprobs is not None, "echo", "echo together with logprobs (prompt logprobs)")
    if logprobs is not None:
        _set_logprobs(common["sampling"], logprobs, "logprobs")
    return CompletionRequest(prompts=prompts, echo=echo, **common)


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
                raise bad_request(f"messages[{index}].content: only text parts are supported, got {kind!r:.40}",
                                  "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        if m["role"] not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m['role']!r:.40}", "messages"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        parsed.append({"role": role, "content": _message_text(m.get("content"), i)})
    return parsed


def _generation_prompt_flags(body: dict) -> tuple[bool, bool]:
    add = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if add and cont:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    return add, cont


def parse_chat(body: Any, max_choices: int = DEFAULT_MAX_CHOICES) -> ChatRequest:
    """POST /v1/chat/completions body -> ChatRequest (raises APIError with status 400)."""
    body = _require_object(body)
    parsed = parse_messages(body)
    _unsupported_if(bool(body.get("tools")) or bool(body.get("functions")), "tools", "tool calling")
    fmt = body.get("response_format")
    _unsupported_if(fmt is not None and fmt != {"type": "text"}, "response_format", "a response_format other than text")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    common = _common(body, max_tokens, None, 1, max_choices)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and top < 0:
        raise bad_request(f"top_logprobs must be a non-negative integer, got {top}", "top_logprobs")
    if top is not None and top > 0 and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if logprobs:
        _set_logprobs(common["sampling"], top or 0, "top_logprobs")
    add, cont = _generation_prompt_flags(body)
    return ChatRequest(
        messages=parsed,
        add_generation_prompt=add,
        continue_final_message=cont,
        logprobs=logprobs,
        top_logprobs=top or 0,
        **common,
    )


def prompt_param(req: GenerateRequest) -> str:
    return "messages" if isinstance(req, ChatRequest) else "prompt"


def sampling_for_prompt(req: GenerateRequest, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams for one prompt: the prompt checked against the context length, and max_tokens
    filled up to the room left when the client left it open (a copy; the request's own stays untouched)."""
    given = req.sampling.max_tokens if req.max_tokens_given else None
    try:
        check_prompt_len(prompt_tokens, max_model_len, given)
    except PromptTooLong as e:
        raise context_length_exceeded(e, prompt_param(req)) from e
    except InvalidParameter as e:
        raise bad_request(str(e), prompt_param(req)) from e
    sampling = copy.copy(req.sampling)
    if not req.max_tokens_given:
        room = max_model_len - prompt_tokens
        sampling.max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        if sampling.min_tokens > sampling.max_tokens:
            raise bad_request(f"min_tokens ({sampling.min_tokens}) exceeds the {sampling.max_tokens} tokens left "
                              f"in the context after the prompt", "min_tokens")
    return sampling


def child_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n choices of one prompt: vLLM's rule, a seed of `seed + i` (unseeded choices stay unseeded)."""
    if sampling.seed is None or index == 0:
        return sampling
    child = copy.copy(sampling)
    seed = sampling.seed + index
    child.seed = seed if seed <= INT64_MAX else INT64_MIN + (seed - INT64_MAX - 1)  # wrap as int64 arithmetic
    return child


# ----------------------------------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None = None  # completion style
    messages: list[dict[str, str]] | None = None  # chat style
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _require_object(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    strs = _bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        add, cont = _generation_prompt_flags(body)
        return TokenizeRequest(model, messages=parse_messages(body), add_special_tokens=_bool(
            body, "add_special_tokens", False), add_generation_prompt=add, continue_final_message=cont,
            return_token_strs=strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt (a string) or messages (a list) is required", "prompt")
    return TokenizeRequest(model, prompt=prompt, add_special_tokens=_bool(body, "add_special_tokens", True),
                           return_token_strs=strs)


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    body = _require_object(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    tokens = body.get("tokens")
    if not _is_ids(tokens):
        raise bad_request("tokens must be a list of token ids", "tokens")
    return model, list(tokens)


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


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


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs=None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, logprobs=None, usage_=None,
    index: int = 0,
) -> dict[str, Any]:
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [completion_choice(index, text, finish_reason, logprobs)],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_choice(index: int, content: str, finish_reason: str | None, logprobs=None) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict, finish_reason: str | None, logprobs=None, usage_=None,
    index: int = 0,
) -> dict[str, Any]:
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
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

"""POST /v1/completions, /v1/chat/completions, /tokenize and /detokenize: read and check the request, tokenize off
the event loop, then hand the choices to pdserve.server.generation.

Order of checks, cheapest first, so a bad or oversized request costs almost nothing: body size, encoding and
time (pdserve.server.body), strict JSON, field validation (pdserve.protocol), model name, the `pd` signature,
the latency budget, prompt length in characters (no tokenizing a prompt that cannot fit), then tokenization and
token-id checks against the vocabulary (pdserve.validation).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from aiohttp import web

from pdserve import protocol as P
from pdserve.engine.messages import import_params
from pdserve.server.body import read_json
from pdserve.server.errors import json_response
from pdserve.server.formats import ChatFormat, CompletionFormat, OutputFormat
from pdserve.server.generation import Child, generate
from pdserve.server.metrics import RequestTracker
from pdserve.server.state import ServerState, state
from pdserve.signing import check_pd_field
from pdserve.validation import InvalidParameter, check_request_token_ids, check_token_ids

log = logging.getLogger("pdserve.server")


async def read_request(request: web.Request, s: ServerState) -> tuple[bytes, Any]:
    return await read_json(request, s.config.body_read_timeout_s, s.config.max_request_bytes)


def check_model(s: ServerState, model: str | None) -> None:
    if model is not None and model not in (s.model_name, s.config.engine.model):
        raise P.model_not_found(model)


def vocab_size(llm: Any) -> int | None:
    """The largest valid token id + 1: the model's vocabulary where the engine reports it, else the tokenizer's."""
    sizes = [getattr(llm, "info", {}).get("vocab_size"), getattr(llm.tokenizer, "vocab_size", None)]
    sizes = [n for n in sizes if isinstance(n, int) and n > 0]
    return min(sizes) if sizes else None


def check_ids(ids: list[int], vocab: int | None, what: str = "prompt") -> None:
    try:
        check_token_ids(ids, vocab, what)
    except InvalidParameter as e:
        raise P.from_invalid(e) from e


def check_chars(s: ServerState, num_chars: int, param: str) -> None:
    """Refuse text that cannot fit the context whatever it says, before tokenizing it."""
    limit = s.max_prompt_chars()
    if limit is not None and num_chars > limit:
        n = s.llm.max_model_len
        raise P.APIError(
            f"This model's maximum context length is {n} tokens. However, your prompt has {num_chars} characters, "
            f"more than {n} tokens can hold ({limit} characters); it was not tokenized. Please reduce the length of "
            f"the prompt.", 400, "invalid_request_error", param, "context_length_exceeded")


def children_for(s: ServerState, req: P.GenerateRequest, fmt: OutputFormat,
                 prompts: list[tuple[list[int], str]], arrival: float) -> list[Child]:
    """One Child per choice: prompt p's i-th choice has index p * n + i (OpenAI's and vLLM's order). `arrival`
    (time.perf_counter(), taken once the body was read) starts each choice's latency clock, so the server's TTFT and
    E2E histograms hold the prompt's tokenization."""
    total = len(prompts) * req.n
    try:
        pd = import_params(req.pd)
    except ValueError as e:
        raise P.bad_request(str(e), "pd") from e
    children = []
    for p, (ids, echo) in enumerate(prompts):
        base = P.sampling_for_prompt(req, len(ids), s.llm.max_model_len)
        for i in range(req.n):
            k = p * req.n + i
            rid = fmt.rid if total == 1 else f"{fmt.rid}-{k}"
            kv = pd
            if kv is not None and total > 1 and kv.router_request_id is not None:  # each choice: its own handover
                kv = dataclasses.replace(kv, router_request_id=f"{kv.router_request_id}-{k}")
            tracker = RequestTracker(s.metrics, arrival)
            tracker.prompt_tokens = len(ids)
            children.append(Child(fmt.new_choice(k, echo), rid, ids, P.child_sampling(base, i), kv, i == 0, tracker))
    return children


async def admit(request: web.Request, s: ServerState, raw: bytes, req: P.GenerateRequest, num_choices: int) -> None:
    """Checks that need no tokenization: model, the `pd` signature, the token ids the sampling parameters name,
    and the latency budget (so an overloaded server refuses before tokenizing)."""
    check_model(s, req.model)
    check_pd_field(s.secret, request, raw, req.pd)
    try:
        check_request_token_ids([], req.sampling, vocab_size(s.llm))
    except InvalidParameter as e:
        raise P.from_invalid(e) from e
    s.admission.check(num_choices)


async def completions(request: web.Request) -> web.StreamResponse:
    s = state(request)
    raw, body = await read_request(request, s)
    arrival = time.perf_counter()
    req = P.parse_completion(body, s.config.max_choices)
    await admit(request, s, raw, req, len(req.prompts) * req.n)
    for prompt in req.prompts:
        if isinstance(prompt, str):
            check_chars(s, len(prompt), "prompt")
    vocab = vocab_size(s.llm)
    prompts: list[tuple[list[int], str]] = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            ids = await s.tokens.encode(prompt)
            echo = prompt if req.echo else ""
        else:
            ids = prompt
            check_ids(ids, vocab)
            echo = await s.tokens.decode(ids) if req.echo else ""
        if not ids:
            raise P.bad_request("prompt must not be empty", "prompt")
        prompts.append((ids, echo))
    fmt = CompletionFormat(P.new_id("cmpl"), s.model_name, s.llm.tokenizer, req.sampling.logprobs,
                           req.tokens_as_ids)
    return await generate(request, s, req, children_for(s, req, fmt, prompts, arrival), fmt)


async def encode_chat(s: ServerState, messages: list[dict], add_generation_prompt: bool,
                      continue_final_message: bool, add_special_tokens: bool = False) -> list[int]:
    check_chars(s, sum(len(m["content"]) for m in messages), "messages")
    try:
        return await s.tokens.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          add_special_tokens=add_special_tokens)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise P.bad_request(f"messages could not be rendered with the model's chat template: {e}", "messages") from e
    except Exception as e:  # jinja2's TemplateError from the template's raise_exception, without importing jinja2
        if type(e).__module__.startswith("jinja2"):
            raise P.bad_request(f"messages rejected by the model's chat template: {e}", "messages") from e
        raise


async def chat_completions(request: web.Request) -> web.StreamResponse:
    s = state(request)
    raw, body = await read_request(request, s)
    arrival = time.perf_counter()
    req = P.parse_chat(body, s.config.max_choices)
    await admit(request, s, raw, req, req.n)
    ids = await encode_chat(s, req.messages, req.add_generation_prompt, req.continue_final_message)
    fmt = ChatFormat(P.new_id("chatcmpl"), s.model_name, s.llm.tokenizer, req.logprobs, req.tokens_as_ids)
    return await generate(request, s, req, children_for(s, req, fmt, [(ids, "")], arrival), fmt)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: completion-style {prompt} or chat-style {messages} -> count, max_model_len, tokens."""
    s = state(request)
    _, body = await read_request(request, s)
    req = P.parse_tokenize(body)
    check_model(s, req.model)
    if req.messages is not None:
        ids = await encode_chat(s, req.messages, req.add_generation_prompt, req.continue_final_message,
                                req.add_special_tokens)
    else:
        check_chars(s, len(req.prompt or ""), "prompt")
        ids = await s.tokens.encode(req.prompt or "", req.add_special_tokens)
    strs = await s.tokens.token_strs(ids) if req.return_token_strs else None
    return json_response(P.tokenize_response(list(ids), s.llm.max_model_len, strs))


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept, as vLLM decodes)."""
    s = state(request)
    _, body = await read_request(request, s)
    model, tokens = P.parse_detokenize(body)
    check_model(s, model)
    check_ids(tokens, vocab_size(s.llm), "tokens")
    return json_response({"prompt": await s.tokens.decode(tokens, skip_special_tokens=False)})

"""Malformed requests for the fuzz tests of the instance (tests/server/test_fuzz.py) and the router
(tests/router/test_router_fuzz.py), and the checks every answer must pass: no 5xx, no hang, every error body
OpenAI's JSON error object.

Classes: wrong types and out-of-range values for every field, huge numbers, NaN/Infinity, nested junk, bad UTF-8
and lone surrogates, unknown or lying Content-Encodings, wrong methods, unknown paths, oversized bodies, truncated
bodies (raw sockets), random byte mutations of valid bodies, and unsigned `pd` orders. Deterministic per seed.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

GENERATE = ("/v1/completions", "/v1/chat/completions")
MSGS = [{"role": "user", "content": "hi"}]
HUGE = 10**30


@dataclass
class Case:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None  # sent as is over a socket (truncated bodies)
    half_close: bool = False  # raw: the client then shuts its side (a server may close without answering)
    label: str = ""


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _field_values() -> dict[str, list[Any]]:
    return {
        "prompt": [5, 1.5, None, True, {}, {"a": 1}, [], [[]], [1, "x"], [[1], "x"], [-1], [2**70], [[300000]],
                   ["a", None], [[1.5]], [True]],
        "messages": [None, "hi", [], [{}], [{"role": 5}], [{"role": "robot", "content": "x"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": [{"type": "text", "text": 7}]}], [["user", "x"]]],
        "max_tokens": ["5", 5.5, True, -1, 0, HUGE, -HUGE, [], 10**6],
        "temperature": ["hot", -1, 3, 1e308, -0.5, [], {}],
        "top_p": [0, 2, -1, "x", 1e-400],
        "top_k": [-5, 10**19, 1.5, "x", -(2**63) - 1, 2**63],
        "min_p": [-0.1, 1.1, "x"],
        "seed": [2**64, -(2**70), "x", 1.5, [], 2**63],
        "n": [0, -1, 10**9, 1000, "2", 2.0],
        "logprobs": [21, -1, "x", 10**9, 1.5],
        "top_logprobs": [21, -1, "x", 50],
        "stop": [[1], [""], ["a"] * 20, 5, {"a": 1}, [None]],
        "stop_token_ids": [[300000], [-1], ["x"], 5, [2**64], [[1]]],
        "logit_bias": [{"x": 1}, {"1": "a"}, {"-5": 1}, {"999999": 1}, [1], "x", {"1": 1e999}, {"1": None},
                       {str(2**70): 1}, {"1.5": 2}],
        "presence_penalty": [5, "a", -2.5, []],
        "frequency_penalty": [-3, "a", 1e300],
        "repetition_penalty": [0, -1, "x", 1e-400],
        "min_tokens": [-1, 10**6, "x", 1.5],
        "allowed_token_ids": [[], [300000], [-1], "x", [1.5]],
        "stream": ["yes", 1, None, []],
        "stream_options": [{"include_usage": True}, "x", {"include_usage": "yes"}],
        "echo": ["x", 2],
        "best_of": [5, 0, "x"],
        "suffix": ["s", 5],
        "response_format": [{"type": "json_object"}, "x", {"type": "json_schema"}],
        "tools": [[{"type": "function"}], "x"],
        "model": [5, "nope", [], {}],
        "pd": ["x", {"prefill_urls": ["http://127.0.0.1:1"], "request_id": "x"}, {}],
        "add_generation_prompt": ["x", 5],
        "continue_final_message": [True, "x"],
    }


def _valid(path: str) -> dict[str, Any]:
    if path.endswith("chat/completions"):
        return {"messages": MSGS, "max_tokens": 1}
    return {"prompt": "hi", "max_tokens": 1}


def generate_cases(seed: int, n: int, max_request_bytes: int) -> list[Case]:
    """`n` malformed requests (plus a fixed set of every class), in a deterministic order."""
    rng = random.Random(seed)
    fixed: list[Case] = []
    values = _field_values()
    completion_only = {"prompt", "echo", "suffix", "logprobs"}
    chat_only = {"messages", "top_logprobs", "tools", "response_format", "add_generation_prompt",
                 "continue_final_message"}
    for name, vals in values.items():  # every wrong value of every field, on the endpoints that read it
        paths = GENERATE[:1] if name in completion_only else GENERATE[1:] if name in chat_only else GENERATE
        for v in vals:
            for path in paths:
                body = _valid(path)
                body[name] = v
                fixed.append(Case("POST", path, _json(body), label=f"field {name}={str(v)[:30]}"))
    raw_bodies = [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                  b'{"prompt": "x", "top_p": -Infinity}', b'{"prompt": "x", "max_tokens": 1e999}',
                  b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", b'{"prompt": "\\ud800"}',
                  b'{"prompt": "\\udfff\\ud800"}', b'{"\\udbff": 1}', b'{"prompt": "\xc3\x28"}', b"\xff\xfe\x00",
                  b"\xef\xbb\xbf{}", "{}".encode("utf-16"), b"", b"null", b"[]", b"5", b'"x"', b"true",
                  b'{"prompt": "x"', b'{"prompt": "x",}', b"{'prompt': 'x'}", b"\x00" * 100,
                  b'{"prompt": "x", "prompt": 5}',
                  b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 1}']
    for depth in (65, 100, 999, 5000, 20000):
        raw_bodies.append(b"[" * depth + b"]" * depth)
        raw_bodies.append(b'{"a":' * depth + b"1" + b"}" * depth)
        raw_bodies.append(b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}")
    for raw in raw_bodies:
        for path in GENERATE + ("/tokenize", "/detokenize"):
            fixed.append(Case("POST", path, raw, label=f"raw {raw[:30]!r}"))
    plain = _json({"prompt": "hi", "max_tokens": 1})
    for enc, data in [("bogus", plain), ("zstd", plain), ("br", plain), ("gzip", plain), ("deflate", plain),
                      ("gzip", gzip.compress(plain)[:-6]), ("gzip", gzip.compress(b"{not json")),
                      ("gzip, deflate", gzip.compress(plain)), ("gzip", gzip.compress(plain) + b"junk"),
                      ("deflate", zlib.compress(b"[" * 10000)),
                      ("gzip", gzip.compress(b" " * (max_request_bytes * 4)))]:  # a small bomb
        for path in GENERATE:
            fixed.append(Case("POST", path, data, {"Content-Encoding": enc}, label=f"encoding {enc}"))
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        for path in GENERATE + ("/tokenize", "/detokenize"):
            fixed.append(Case(method, path, plain, label=f"method {method}"))
    for path in ("/v1/models", "/health", "/version", "/load", "/metrics"):
        fixed.append(Case("POST", path, plain, label="method POST"))
    for path in ("/v2/completions", "/v1/", "/v1/completions/x", "/v1/../etc/passwd", "/" + "a" * 4000,
                 "/v1/completions%00", "/internal", "/%ff%fe", "/v1/models/" + "m" * 300, "/admin"):
        fixed.append(Case("POST", path, plain, label="path"))
        fixed.append(Case("GET", path, b"", label="path"))
    big = _json({"prompt": "x" * max_request_bytes})
    for path in GENERATE + ("/tokenize", "/detokenize"):
        fixed.append(Case("POST", path, big, label="oversized"))
        fixed.append(Case("POST", path, _json({"prompt": [1] * (max_request_bytes // 2)}), label="oversized ids"))
    for i, path in enumerate(GENERATE * 3):  # truncated: the body never completes (408), or the client gives up
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {200 + i}\r\n\r\n").encode()
        fixed.append(Case("POST", path, raw=head + b'{"prompt": "abc", "max_tok', half_close=i % 2 == 1,
                          label="truncated"))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    fixed.append(Case("POST", "/v1/completions", raw=head + b"5\r\n{\"pro\r\n", label="truncated chunked"))
    fixed.append(Case("POST", "/v1/completions", raw=head + b"zz\r\nxx\r\n0\r\n\r\n", label="bad chunked"))
    fixed.append(Case("POST", "/tokenize", _json({"prompt": "x" * (max_request_bytes // 2)}), label="long prompt"))
    fixed.append(Case("POST", "/detokenize", _json({"tokens": [300000, -1]}), label="detokenize out of vocab"))
    fixed.append(Case("POST", "/tokenize", _json({"messages": "x"}), label="tokenize bad chat"))
    # random mutations of a valid completion body until there are n cases (completions: a mutation that deletes
    # max_tokens leaves vLLM's default of 16, where chat would generate up to the context length)
    cases = list(fixed)
    path = GENERATE[0]
    template = _json(_valid(path) | {"temperature": 0.5, "stop": ["\n"], "logit_bias": {"5": 1}})
    while len(cases) < n:
        data = bytearray(template)
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.4:
                data[pos] = rng.randrange(256)
            elif op < 0.6:
                del data[pos:pos + rng.randint(1, 8)]
            elif op < 0.8:
                data[pos:pos] = rng.choice([b"[", b"{", b"\\u", b'"', b",", b"1e999", b"\xff", b"-"])
            else:
                data = data[:pos]
        cases.append(Case("POST", path, bytes(data), label="mutation"))
    rng.shuffle(cases)
    return cases


def check_error_body(status: int, content_type: str, body: bytes, label: str) -> None:
    assert content_type.startswith("application/json"), (label, status, content_type, body[:200])
    obj = json.loads(body)
    err = obj["error"]
    assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), (label, obj)
    assert isinstance(err["message"], str) and isinstance(err["type"], str), (label, obj)
    assert "Traceback" not in err["message"], (label, obj)


async def send(session: aiohttp.ClientSession, base: str, case: Case, timeout_s: float,
               headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body); raises on a hang (timeout) or a broken connection. `headers` are added to
    raw requests too (the session adds them to the others)."""
    if case.raw is not None:
        line, _, rest = case.raw.partition(b"\r\n")
        extra = b"".join(f"{k}: {v}\r\n".encode() for k, v in (headers or {}).items())
        return await _send_raw(base, line + b"\r\n" + extra + rest, timeout_s, case.half_close)
    headers = {"Content-Type": "application/json", **case.headers}
    async with session.request(case.method, base + case.path, data=case.body, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


CLOSED_WITHOUT_ANSWER = 0  # the pseudo-status of a raw case whose connection the server closed (after a half-close)


async def _send_raw(base: str, data: bytes, timeout_s: float, half_close: bool) -> tuple[int, str, bytes]:
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()  # the client gives up sending: the body stays truncated
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        except asyncio.IncompleteReadError:
            if half_close:
                return CLOSED_WITHOUT_ANSWER, "", b""
            raise
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(length), timeout_s)
        return status, headers.get("content-type", ""), body
    finally:
        writer.close()


async def run_fuzz(base: str, cases: list[Case], concurrency: int = 16, timeout_s: float = 30.0,
                   headers: dict[str, str] | None = None) -> dict[int, int]:
    """Send every case; assert the answer's shape; return a histogram of statuses."""
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, headers=headers or {}, auto_decompress=False) as s:
        async def one(case: Case) -> None:
            async with sem:
                try:
                    status, ctype, body = await send(s, base, case, timeout_s, headers)
                except asyncio.TimeoutError:
                    raise AssertionError(f"no answer within {timeout_s} s: {case.label}") from None
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (case.label, status, body[:300])
            if status == CLOSED_WITHOUT_ANSWER:
                return
            if status >= 400:
                if case.raw is not None and status == 400 and not ctype.startswith("application/json"):
                    return  # malformed HTTP framing is answered by aiohttp's parser before any handler runs
                check_error_body(status, ctype, body, case.label)

        await asyncio.gather(*(one(c) for c in cases))
    return statuses


async def fuzz_during(streams: Callable[[], Awaitable[list[str]]], base: str, cases: list[Case],
                      **kw: Any) -> tuple[list[list[str]], dict[int, int], float]:
    """Run the fuzz while rounds of `streams()` run back to back (each round starts while the fuzz still runs).
    Returns every round's outputs, the status histogram and the fuzz's duration."""
    loop = asyncio.get_running_loop()

    async def timed() -> tuple[dict[int, int], float]:
        t0 = loop.time()
        statuses = await run_fuzz(base, cases, **kw)
        return statuses, loop.time() - t0

    fuzz = asyncio.ensure_future(timed())
    rounds: list[list[str]] = []
    while not rounds or not fuzz.done():
        rounds.append(await streams())
    statuses, took = await fuzz
    return rounds, statuses, took

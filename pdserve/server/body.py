"""Reading a request body safely: bounded in size and time, a known Content-Encoding, strict JSON.

Why strict: Python's json accepts NaN and Infinity (not JSON), turns 1e999 into inf, builds strings with lone
surrogates from `\\ud800` escapes (which later fail to encode), and recurses once per nesting level (5,000 levels
raise RecursionError). Each of those became a 500 or an engine failure; here each is a 400 before any handler
logic runs. The instance server and the router share this module.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import zlib
from typing import Any

from aiohttp import web

from pdserve.protocol import APIError, bad_request

try:  # parses a 32k-token prompt's body in about a third of the stdlib's time (benchmarks/router/intake_costs.py)
    import orjson
except ImportError:  # a machine without it (the lent GPU image): the stdlib parser, same checks
    orjson = None

# Decoded here, not by aiohttp: its parser treats an unknown coding as identity, answers codings it lacks a library
# for (zstd, br) with a plain-text 400 before any middleware runs, and a broken gzip body became a 500. Servers are
# therefore run with RUNNER_OPTIONS (auto_decompress off) and every coding is handled, or refused (415), below.
SUPPORTED_ENCODINGS = ("identity", "gzip", "deflate")
RUNNER_OPTIONS = {"auto_decompress": False}
MAX_JSON_DEPTH = 64  # OpenAI request bodies nest about 5 deep (messages[i].content[j].text)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_content_encoding(request: web.Request) -> None:
    enc = request.headers.get("Content-Encoding")
    if enc is None:
        return
    codings = [c.strip().lower() for c in enc.split(",") if c.strip()]
    if len(codings) > 1 or (codings and codings[0] not in SUPPORTED_ENCODINGS):
        raise APIError(f"Unsupported Content-Encoding {enc[:40]!r}: send one of {', '.join(SUPPORTED_ENCODINGS)}",
                       415, "invalid_request_error", None, "unsupported_content_encoding")


async def read_body(request: web.Request, timeout_s: float, max_bytes: int) -> bytes:
    """The whole (decoded) body: 415 for an unknown encoding, 413 over `max_bytes` (the app's client_max_size,
    which aiohttp enforces while reading), 408 when the client does not finish sending it within `timeout_s`,
    400 when it cannot be decoded."""
    check_content_encoding(request)
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(f"The request body did not arrive within {timeout_s:g} s", 408, "invalid_request_error",
                       None, "request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(f"The request body is larger than {max_bytes} bytes", 413, "invalid_request_error", None,
                       "request_too_large") from None
    except web.HTTPException:
        raise
    except Exception as e:  # aiohttp's RequestPayloadError (truncated chunked body, ...)
        raise bad_request(f"The request body could not be read: {type(e).__name__}: {str(e).strip()[:200]}") from None
    coding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    return raw if coding == "identity" else decompress(raw, coding, max_bytes)


def decompress(raw: bytes, coding: str, max_bytes: int) -> bytes:
    """gzip or deflate (zlib-wrapped or raw, as browsers send either), at most `max_bytes` of output."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[coding]
    for attempt in (wbits, -zlib.MAX_WBITS) if coding == "deflate" else (wbits,):
        d = zlib.decompressobj(attempt)
        try:
            out = d.decompress(raw, max_bytes + 1)
        except zlib.error as e:
            if attempt != -zlib.MAX_WBITS and coding == "deflate":
                continue
            raise bad_request(f"The request body could not be read: it is not valid {coding} data ({e})") from None
        if len(out) > max_bytes:
            raise APIError(f"The request body is larger than {max_bytes} bytes once decoded", 413,
                           "invalid_request_error", None, "request_too_large")
        if not d.eof or d.unused_data:
            raise bad_request(f"The request body could not be read: the {coding} data is truncated or has "
                              "trailing bytes")
        return out
    raise AssertionError("unreachable")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_tree(obj: Any) -> None:
    """Depth bound and well-formed strings (no unpaired surrogates), iteratively."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = ((None, v) for v in node)
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels")
        for key, value in items:
            for s in (key, value):
                if isinstance(s, str) and not s.isascii():
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        raise bad_request("The request body contains a string with an unpaired UTF-16 surrogate "
                                          "escape (e.g. \\ud800); strings must be valid Unicode") from None
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))


def parse_json(raw: bytes) -> Any:
    """Strict JSON from UTF-8 bytes, or a 400 saying what is wrong."""
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid UTF-8 (byte {e.start})") from None
    # orjson for the bodies it reads as the stdlib does; anything it refuses is parsed again by the stdlib below,
    # whose errors say what is wrong (NaN, out of range, nesting, surrogates), as are bodies with surrogate escapes.
    # It reads integers beyond 64 bits as floats: a top-level member that came out so is read again by the stdlib
    # (an exact int, as `seed` or `max_tokens` expect); inside lists (token ids) such a float is refused as no int.
    if orjson is not None and not _SURROGATE_ESCAPE.search(raw):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if obj is not None and not (isinstance(obj, dict) and any(
                isinstance(v, float) and abs(v) >= 2.0 ** 63 for v in obj.values())):
            if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
                _check_tree(obj)
            return obj
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON: {str(e)[:200]}") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        _check_tree(obj)  # only bodies that could fail a check are walked
    return obj


def extend_json_object(raw: bytes, obj: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """The JSON object `raw` (parsed into `obj`) with the members of `extra` added, without re-encoding the body:
    they are appended after its last member (a 32k-token prompt re-encoded costs milliseconds). A member `obj`
    already has is replaced by re-encoding the whole object instead, so the result never repeats a name."""
    if not extra:
        return raw
    body = raw.strip()
    if not obj or not body.startswith(b"{") or not body.endswith(b"}") or any(k in obj for k in extra):
        return json.dumps({**obj, **extra}, ensure_ascii=False).encode()
    return body[:-1] + b"," + json.dumps(extra, ensure_ascii=False, separators=(",", ":")).encode()[1:]


async def read_json(request: web.Request, timeout_s: float, max_bytes: int) -> tuple[bytes, Any]:
    """(raw body, parsed JSON): the raw bytes are what a request signature covers."""
    raw = await read_body(request, timeout_s, max_bytes)
    return raw, parse_json(raw)

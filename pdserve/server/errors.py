"""Every error as OpenAI's JSON error object: the aiohttp middleware the instance server and the router share.

Why a middleware and not per-handler care: aiohttp itself raises for unknown paths (404), wrong methods (405) and
oversized bodies (413) with plain-text bodies, and any bug in a handler would leave as a 500 with aiohttp's text;
here each becomes `{"error": {"message", "type", "param", "code"}}` with its status, and nothing leaks a trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pdserve.protocol import APIError, error_body

log = logging.getLogger("pdserve.server")

_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
_PASSED_HEADERS = ("allow", "retry-after", "www-authenticate")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(obj, ensure_ascii=False).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(e: APIError) -> web.Response:
    return json_response(e.body(), e.status, e.headers)


def http_error_response(request: web.Request, e: web.HTTPException) -> web.Response:
    """An aiohttp HTTP error as OpenAI's error JSON (bodies that already are one pass through unchanged)."""
    headers = {k: v for k, v in e.headers.items() if k.lower() in _PASSED_HEADERS}
    if e.content_type == "application/json" and e.text:
        try:
            body = json.loads(e.text)
        except ValueError:
            body = None
        if isinstance(body, dict) and "error" in body:
            return json_response(body, e.status, headers)
    kind = _HTTP_ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
    message = f"{e.reason}: {request.method} {request.path}" if e.status in (404, 405) else (e.text or e.reason)
    return json_response(error_body(message, kind, code=str(e.status)), e.status, headers)


def close_if_unread(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """An error answered before the body was read (or while it was broken) ends the connection: the unread rest
    of the body must not be parsed as the next request."""
    if request.can_read_body and not request.content.is_eof():
        resp.force_close()
    return resp


def error_middleware(on_api_error: Callable[[web.Request, APIError], None] | None = None):
    """APIError as is, HTTP errors by status, anything else as a plain 500 (logged with its trace)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            if on_api_error is not None:
                on_api_error(request, e)
            return close_if_unread(request, error_response(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return close_if_unread(request, http_error_response(request, e))
        except (ConnectionResetError, BrokenPipeError):
            raise
        except asyncio.TimeoutError:  # a bounded wait (tokenization, an upstream) ran out: busy, not broken
            log.warning("timed out in %s %s", request.method, request.path)
            body = error_body("The server did not finish this request in time; retry later", "server_error",
                              code="timeout")
            return close_if_unread(request, json_response(body, 503, {"Retry-After": "1"}))
        except Exception as e:  # the last line of defence: log the trace, answer without it
            log.exception("unhandled error in %s %s", request.method, request.path)
            body = error_body(f"Internal server error ({type(e).__name__}); see the server log.", "server_error")
            return close_if_unread(request, json_response(body, 500))

    return middleware

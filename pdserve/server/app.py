"""The instance's aiohttp application: OpenAI routes, health, version, load and metrics.

Why a factory taking the engine: the same app serves a colocated instance, a prefill or a decode instance
(the PD layer adds its internal routes through `extra_routes`), and tests build it around any engine.
Every error leaves as OpenAI's JSON error object with a meaningful status; nothing leaks a stack trace.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve import __version__
from pdserve.config import ServerConfig
from pdserve.protocol import APIError, error_body, model_not_found
from pdserve.server.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("pdserve.server")

MAX_BODY_BYTES = 64 * 1024 * 1024  # long prompts sent as token-id lists run to megabytes


@dataclass
class ServerState:
    """What every handler needs, stored once on the app."""

    llm: Any  # pdserve.engine.async_llm.AsyncLLM, or anything with the same interface
    config: ServerConfig
    metrics: ServerMetrics
    model_name: str
    created: int


STATE = web.AppKey("pdserve_state", ServerState)


def state(request: web.Request) -> ServerState:
    return request.app[STATE]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(obj, ensure_ascii=False).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(e: APIError) -> web.Response:
    return json_response(e.body(), e.status, e.headers)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def engine_stats(llm: Any) -> dict:
    return dict(await maybe_await(llm.stats()))


_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@web.middleware
async def error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Map every failure to OpenAI's error JSON: APIError as is, HTTP errors by status, the rest as a plain 500."""
    try:
        return await handler(request)
    except APIError as e:
        if request.path.startswith("/v1/"):  # failures after admission are counted by the request's tracker
            if e.status < 500:
                state(request).metrics.outcome("invalid")
            elif e.code in ("queue_full", "engine_dead"):
                state(request).metrics.outcome("rejected")
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = _HTTP_ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        message = f"{e.reason}: {request.method} {request.path}" if e.status in (404, 405) else (e.text or e.reason)
        return json_response(error_body(message, kind, code=str(e.status)), e.status, headers)
    except (ConnectionResetError, BrokenPipeError):
        raise
    except Exception as e:  # the last line of defence: log the trace, answer without it
        log.exception("unhandled error in %s %s", request.method, request.path)
        body = error_body(f"Internal server error ({type(e).__name__}); see the server log.", "server_error")
        return json_response(body, 500)


async def health(request: web.Request) -> web.Response:
    """200 while the engine answers; 503 (with the reason) once it has died, so routers drain this instance."""
    llm = state(request).llm
    try:
        await engine_stats(llm)
    except Exception as e:
        return json_response(error_body(f"engine unavailable: {e}", "server_error"), 503)
    if not getattr(llm, "is_alive", True):
        return json_response(error_body("the engine process is not running", "server_error"), 503)
    return web.Response(text="OK")


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


def model_card(s: ServerState) -> dict:
    return {
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "pdserve",
        "root": s.config.engine.model,
        "parent": None,
        "max_model_len": s.llm.max_model_len,
    }


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [model_card(state(request))]})


async def model(request: web.Request) -> web.Response:
    s = state(request)
    name = request.match_info["model"]
    if name not in (s.model_name, s.config.engine.model):
        raise model_not_found(name)
    return json_response(model_card(s))


async def load(request: web.Request) -> web.Response:
    """The engine's load snapshot (running, waiting, KV usage, ...), polled by the router."""
    s = state(request)
    stats = await engine_stats(s.llm)
    stats["role"] = s.config.role
    return json_response(stats)


async def metrics(request: web.Request) -> web.Response:
    s = state(request)
    try:
        stats = await engine_stats(s.llm)
    except Exception:
        log.warning("engine stats unavailable for /metrics", exc_info=True)
        stats = {}
    return web.Response(body=s.metrics.render(stats), headers={"Content-Type": CONTENT_TYPE})


def create_app(
    llm: Any,
    server_config: ServerConfig,
    extra_routes: Callable[[web.Application], None] | None = None,
) -> web.Application:
    """Build the app around a started engine. `extra_routes(app)` may add routes (the PD layer's internal API)."""
    from pdserve.server import openai_routes  # imports torch-free modules only; kept local to avoid a cycle

    name = getattr(llm, "model_name", None) or server_config.engine.name
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE] = ServerState(llm, server_config, ServerMetrics(name), name, int(time.time()))
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", openai_routes.completions)
    app.router.add_post("/v1/chat/completions", openai_routes.chat_completions)
    if extra_routes is not None:
        extra_routes(app)
    return app

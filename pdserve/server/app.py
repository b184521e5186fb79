"""The instance's aiohttp application: OpenAI routes, tokenize/detokenize, health, version, load and metrics.

Why a factory taking the engine: the same app serves a colocated instance, a prefill or a decode instance
(the PD layer adds its internal routes through `extra_routes`), and tests build it around any engine.
Every error leaves as OpenAI's JSON error object with a meaningful status (404, 405, 413, 415 and 401 included);
nothing leaks a stack trace. /health and /load read cached engine stats only, so a busy instance answers them at
once (the router's health checks must never time out because the engine is working).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pdserve import __version__
from pdserve.config import ServerConfig
from pdserve.protocol import APIError, error_body, model_not_found
from pdserve.secret import as_secret
from pdserve.server import openai_routes
from pdserve.server.admission import Admission
from pdserve.server.auth import api_key_middleware
from pdserve.server.errors import error_middleware, json_response
from pdserve.server.metrics import CONTENT_TYPE, ServerMetrics
from pdserve.server.state import STATE, ServerState, state
from pdserve.server.stats_log import log_stats
from pdserve.server.tokenizing import TokenizerService

log = logging.getLogger("pdserve.server")


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def engine_stats(llm: Any) -> dict:
    return dict(await maybe_await(llm.stats()))


def engine_waiting(llm: Any) -> int:
    """Requests in the engine's waiting queue, from its last stats (0 where it cannot say synchronously)."""
    stats = llm.stats()
    value = stats.get("num_waiting", 0) if isinstance(stats, dict) else 0
    return value if isinstance(value, int) else 0


REJECTED_CODES = ("queue_full", "engine_dead", "over_budget", "queue_timeout")


def count_error(request: web.Request, e: APIError) -> None:
    """Requests refused before admission, by outcome (failures after it are counted by the request's tracker)."""
    if request.path.startswith("/v1/"):
        if e.status < 500:
            state(request).metrics.outcome("invalid")
        elif e.code in REJECTED_CODES:
            state(request).metrics.outcome("rejected")


async def health(request: web.Request) -> web.Response:
    """200 while the engine process runs; 503 (with the reason) once it has died, so routers drain this instance.
    Never waits on the engine: a busy instance is healthy."""
    llm = state(request).llm
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
    stats.update(s.admission.snapshot())
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

    cfg = server_config
    name = getattr(llm, "model_name", None) or cfg.engine.name
    middlewares = [error_middleware(count_error), api_key_middleware(cfg.api_keys)]
    app = web.Application(middlewares=middlewares, client_max_size=cfg.max_request_bytes)
    tokens = TokenizerService(llm.tokenizer, cfg.tokenizer_workers, timeout_s=cfg.request_timeout_s)
    admission = Admission(cfg.max_queue_wait_s, waiting=lambda: engine_waiting(llm))
    st = ServerState(llm, cfg, ServerMetrics(name), name, int(time.time()), tokens, admission,
                     as_secret(cfg.deployment_secret))
    app[STATE] = st

    async def start_tokens(_app: web.Application) -> None:
        await tokens.start()

    async def stop_tokens(_app: web.Application) -> None:
        await tokens.close()

    async def stats_line(_app: web.Application):  # the engine's stats line in the log (pdserve.server.stats_log)
        task = (asyncio.create_task(log_stats(lambda: engine_stats(llm), cfg.log_stats_interval_s))
                if cfg.log_stats_interval_s else None)
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app.on_startup.append(start_tokens)
    app.on_cleanup.append(stop_tokens)
    app.cleanup_ctx.append(stats_line)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", openai_routes.completions)
    app.router.add_post("/v1/chat/completions", openai_routes.chat_completions)
    app.router.add_post("/tokenize", openai_routes.tokenize)
    app.router.add_post("/detokenize", openai_routes.detokenize)
    if extra_routes is not None:
        extra_routes(app)
    return app

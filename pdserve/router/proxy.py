"""The router's HTTP app: OpenAI routes in front of the pools, PD planning, retries and abort propagation.

Disaggregated requests are decode-driven (one hop): the router picks a decode instance D and an ordered list of
prefill candidates, and forwards the client's body to D with `"pd": {"prefill_urls": [...], "request_id": id}`;
D runs the handover and streams the answer, which the router relays. Requests the router decides to prefill
locally (short uncached prompt, every prefill queue over its limit, no prefill instance) go to D without `pd`.

Every accepted request ends with a response or an error: failures before the client saw a byte are retried on
another decode instance (bounded), failures after are reported as an SSE error event, and client disconnects close
the upstream connection (D aborts) and send best-effort `POST /v1/abort` to every instance involved.

Access: clients need one of the router's API keys (pdserve.server.auth); the router sends its instance key to
instances and signs every request carrying `pd` (and every abort) with the deployment secret, without which it
never disaggregates. Bodies are read as strictly as an instance reads them (pdserve.server.body), and every error,
404/405/413 included, is OpenAI's JSON error object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.protocol import APIError, error_body
from pdserve.router.admission import Admission, Rejected
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RouteRequest, make_policy
from pdserve.router.pool import Instance, Pools
from pdserve.router.prefix import prompt_key
from pdserve.router.sse import SSEFilter, error_event, pop_timings
from pdserve.secret import as_secret
from pdserve.server.auth import api_key_middleware, bearer
from pdserve.server.body import RUNNER_OPTIONS, extend_json_object, parse_json, read_body, read_json
from pdserve.server.errors import error_middleware
from pdserve.signing import sign_request

log = logging.getLogger("pdserve.router")

GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")
# failures of an upstream exchange: retried on another decode instance while the client has seen nothing
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def is_hard(exc: BaseException) -> bool:
    """Connection refused (or similar at connect time) proves the instance is gone; a reset or a timeout may be
    a stale keep-alive connection or a busy instance, so those only count towards the breaker's threshold."""
    return isinstance(exc, aiohttp.ClientConnectorError)


def error_response(status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> web.Response:
    body = error_body(message, type_, None, status)
    return web.json_response(body, status=status, headers=headers)


def read_json_bytes(raw: bytes) -> None:
    """Strict JSON check of a body the router forwards unchanged (raises APIError 400)."""
    if not isinstance(parse_json(raw), dict):
        raise APIError("The request body must be a JSON object")


class Overloaded(str):
    """An attempt's failure message when the instance said 503 (full), so the client gets 503 + Retry-After."""

    retry_after_s = 0  # the instance's own Retry-After, when it sent one


@dataclass
class Plan:
    target: Instance
    mode: str  # pd | local | colocated
    prefill: list[Instance]
    reason: str | None = None  # why local


class _Attempt:
    """One try at one decode instance; the pool's down-hook closes it so reads fail at once."""

    def __init__(self) -> None:
        self.resp: aiohttp.ClientResponse | None = None
        self.down_reason: str | None = None
        self.down = asyncio.get_running_loop().create_future()

    def hook(self, reason: str) -> None:
        self.down_reason = reason
        if not self.down.done():
            self.down.set_result(reason)
        if self.resp is not None:
            self.resp.close()


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools = Pools(config)
        self.metrics = RouterMetrics()
        self.pools.listeners.append(self.metrics.on_state)
        self.admission = Admission(config, self.pools, self.metrics)
        self.prefill_policy = make_policy(config.prefill_policy, config)
        self.decode_policy = make_policy(config.decode_policy, config)
        self.both_policy = make_policy(config.both_policy, config)
        self.session: aiohttp.ClientSession | None = None
        self.secret = as_secret(config.deployment_secret)
        self.upstream_auth = bearer(config.upstream_api_key)
        if config.prefill and self.secret is None:
            log.warning("no deployment secret (PDSERVE_DEPLOYMENT_SECRET or --deployment-secret-file): instances "
                        "refuse unsigned pd orders, so every request is prefilled on its decode instance")
        self._tasks: set[asyncio.Task] = set()
        for inst in self.pools:
            self.metrics.on_state(inst, inst.breaker.state, inst.breaker.state)

    # ---- app and lifecycle ----

    def make_app(self) -> web.Application:
        cfg = self.config
        middlewares = [error_middleware(), api_key_middleware(cfg.api_keys)]
        app = web.Application(middlewares=middlewares, client_max_size=cfg.max_request_bytes)
        for route in GENERATE_ROUTES:
            app.router.add_post(route, self.handle_generate)
        for route in TOKENIZER_ROUTES:
            app.router.add_post(route, self.handle_tokenizer)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/router/status", self.handle_status)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        await self.pools.start(self.session)
        self._spawn(self.admission.run_waker())

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.pools.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.abort_timeout_s + 1)
        if self.session is not None:
            await self.session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- small routes ----

    async def handle_health(self, request: web.Request) -> web.Response:
        targets = self.admission.targets()
        body = {"status": "ok" if targets else "unavailable", "healthy_targets": len(targets),
                "prefill_healthy": len(self.pools.available("prefill"))}
        return web.json_response(body, status=200 if targets else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.render(list(self.pools))
        return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response({"queued": self.admission.queued, "instances": [i.status() for i in self.pools]})

    async def handle_models(self, request: web.Request) -> web.Response:
        """Union of the models served by the healthy instances (one entry per id)."""
        insts = [i for i in self.pools if i.available]
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)

        async def fetch(inst: Instance) -> list[dict[str, Any]]:
            try:
                async with self.session.get(inst.url + "/v1/models", timeout=timeout, headers=self.upstream_auth) as resp:
                    data = await resp.json(content_type=None)
                    return [m for m in data.get("data", []) if isinstance(m, dict)] if resp.status == 200 else []
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
                return []

        models: dict[str, dict[str, Any]] = {}
        for result in await asyncio.gather(*(fetch(i) for i in insts)):
            for model in result:
                models.setdefault(str(model.get("id")), model)
        if not models:
            return error_response(503, "no healthy instance answered /v1/models", "upstream_error")
        return web.json_response({"object": "list", "data": list(models.values())})

    async def handle_tokenizer(self, request: web.Request) -> web.Response:
        """/tokenize and /detokenize: checked here as strictly as an instance would, answered by the healthy decode
        (or colocated) instance with the fewest requests outstanding."""
        cfg = self.config
        raw = await read_body(request, cfg.body_read_timeout_s, cfg.max_request_bytes)
        read_json_bytes(raw)
        targets = self.admission.targets()
        if not targets:
            return error_response(503, "no healthy instance is available", "upstream_error",
                                  headers={"Retry-After": str(cfg.retry_after_s)})
        target = min(targets, key=lambda i: i.inflight)
        headers = {"Content-Type": "application/json", **self.upstream_auth}
        try:
            async with self.session.post(target.url + request.path, data=raw, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=cfg.read_timeout_s)) as resp:
                data = await resp.read()
                content_type = resp.headers.get("Content-Type", "application/json")
                return web.Response(body=data, status=resp.status, headers={"Content-Type": content_type})
        except UPSTREAM_ERRORS as exc:
            return error_response(502, f"instance {target.url} failed: {exc!r}", "upstream_error")

    # ---- planning ----

    def route_request(self, path: str, body: dict[str, Any]) -> RouteRequest:
        cfg = self.config
        key = prompt_key(path, body, cfg.prefix_chunk_chars, cfg.chars_per_token)
        prompt = body.get("prompt")
        copies = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
        n = body.get("n")
        copies *= n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 else 1
        return RouteRequest(est_tokens=key.est_tokens * copies, hashes=key.hashes,
                            tokens_per_chunk=key.tokens_per_chunk)

    def plan(self, req: RouteRequest, exclude: set[str]) -> Plan | None:
        """Pick the decode-side target and, for disaggregation, the ordered prefill candidates."""
        cfg = self.config
        decode = [i for i in self.pools.available("decode") if i.url not in exclude]
        both = [i for i in self.pools.available("both") if i.url not in exclude]
        not_full = [i for i in decode + both if not self.admission.is_full(i)]
        if not_full:  # prefer instances under their limits; full ones only when nothing else is left
            decode = [i for i in decode if i in not_full]
            both = [i for i in both if i in not_full]
        if decode:
            ranked = self.decode_policy.rank(decode + both, req)
        elif both:
            ranked = self.both_policy.rank(both, req)
        else:
            return None
        target = ranked[0]
        if target.role == "both":
            return Plan(target, "colocated", [])
        prefill = self.pools.available("prefill")
        if not prefill:
            return Plan(target, "local", [], "no_prefill")
        if self.secret is None:  # an unsigned pd order would be refused
            return Plan(target, "local", [], "no_secret")
        uncached = req.est_tokens - req.overlap_tokens(target)
        if uncached <= cfg.local_prefill_max_tokens:
            return Plan(target, "local", [], "short")
        limit = cfg.prefill_max_waiting_tokens
        open_prefill = [p for p in prefill if not limit or p.waiting_tokens <= limit]
        if not open_prefill:
            return Plan(target, "local", [], "prefill_busy")
        ranked_prefill = self.prefill_policy.rank(open_prefill, req)[: cfg.max_prefill_candidates]
        return Plan(target, "pd", ranked_prefill)

    # ---- the generate routes ----

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        raw, body = await read_json(request, self.config.body_read_timeout_s, self.config.max_request_bytes)
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "invalid_request_error")
        chat = request.path.endswith("/chat/completions")
        if chat and not isinstance(body.get("messages"), list):
            return error_response(400, "'messages' must be a list", "invalid_request_error")
        if not chat and "prompt" not in body:
            return error_response(400, "'prompt' is required", "invalid_request_error")
        if "pd" in body:
            return error_response(400, "'pd' is reserved for the router", "invalid_request_error")
        try:
            await self.admission.acquire()
        except Rejected as rej:
            retry = max(self.config.retry_after_s, math.ceil(rej.retry_after_s or 0))
            return error_response(rej.status, str(rej), "overloaded", headers={"Retry-After": str(retry)})
        req = self.route_request(request.path, body)
        rid = f"rt-{uuid.uuid4().hex}"
        return await self._dispatch(request, raw, body, req, rid, arrival)

    def _upstream_body(self, raw: bytes, body: dict[str, Any], plan: Plan, rid: str, stream: bool) -> bytes:
        extra: dict[str, Any] = {}
        if plan.mode == "pd":
            extra["pd"] = {"prefill_urls": [p.url for p in plan.prefill], "request_id": rid}
        options = body.get("stream_options")
        if stream and body.get("stream") is True and (options is None or isinstance(options, dict)) \
                and not (isinstance(options, dict) and options.get("include_usage") is True):
            extra["stream_options"] = {**(options or {}), "include_usage": True}
        # anything malformed goes through unchanged: the instance refuses it with a 400
        return extend_json_object(raw, body, extra)

    async def _dispatch(self, request: web.Request, raw: bytes, body: dict[str, Any], req: RouteRequest, rid: str,
                        arrival: float) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        wants_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        tried: set[str] = set()
        last_error = "no healthy decode instance is available"
        for attempt in range(1 + self.config.max_decode_retries):
            plan = self.plan(req, tried)
            if plan is None:
                break
            if attempt:
                self.metrics.decode_retries.inc()
            tried.add(plan.target.url)
            if plan.reason:
                self.metrics.local_prefill.labels(plan.reason).inc()
            # each attempt gets its own id: a late abort of a failed attempt must not hit its retry
            attempt_rid = f"{rid}-{attempt}" if attempt else rid
            result = await self._attempt(request, raw, body, req, attempt_rid, plan, stream, wants_usage, arrival)
            if isinstance(result, web.StreamResponse):
                return result
            last_error = result
        retry_after = {"Retry-After": str(self.config.retry_after_s)}
        if isinstance(last_error, Overloaded):
            self.metrics.requests.labels("none", "overloaded").inc()
            retry = max(self.config.retry_after_s, last_error.retry_after_s)
            return error_response(503, last_error, "overloaded", headers={"Retry-After": str(retry)})
        self.metrics.requests.labels("none", "upstream_error").inc()
        if not tried:
            return error_response(503, last_error, "upstream_error", headers=retry_after)
        return error_response(502, last_error, "upstream_error")

    async def _attempt(self, request: web.Request, raw: bytes, body: dict[str, Any], req: RouteRequest, rid: str,
                       plan: Plan, stream: bool, wants_usage: bool, arrival: float) -> web.StreamResponse | str:
        """Send to plan.target. Returns the client response, or an error string when the caller should retry."""
        target = plan.target
        url = target.url + request.path
        payload = self._upstream_body(raw, body, plan, rid, stream)
        attempt = _Attempt()
        target.active.add(attempt.hook)
        target.inflight += 1
        target.pending_tokens += req.est_tokens
        target.prefix.insert(req.hashes)
        if plan.prefill:
            plan.prefill[0].pending_tokens += req.est_tokens
            plan.prefill[0].prefix.insert(req.hashes)
        try:
            post = asyncio.ensure_future(self._post(url, request.path, payload, rid, plan.mode == "pd"))
            try:
                await asyncio.wait({post, attempt.down}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                post.cancel()
                if post.done() and not post.cancelled() and post.exception() is None:
                    post.result().close()
                raise
            if not post.done():
                post.cancel()
                return f"decode instance {target.url} went down: {attempt.down_reason}"
            try:
                resp = post.result()
            except UPSTREAM_ERRORS as exc:
                self.pools.report_failure(target, hard=is_hard(exc))
                self._abort_prefill(plan, rid)
                log.warning("request %s: decode %s failed before responding: %r", rid, target.url, exc)
                return f"decode instance {target.url} failed: {exc!r}"
            attempt.resp = resp
            self.pools.report_success(target)
            if resp.status == 503:  # instance full: another may take it
                await resp.read()
                resp.release()
                over = Overloaded(f"decode instance {target.url} is overloaded (503)")
                retry = resp.headers.get("Retry-After", "")
                over.retry_after_s = int(retry) if retry.isdigit() and len(retry) < 6 else 0
                return over
            if not stream or resp.status != 200:
                return await self._relay_body(resp, plan, attempt, arrival)
            return await self._relay_stream(request, resp, plan, rid, attempt, wants_usage, arrival)
        except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler)
            self._on_client_gone(plan, rid, attempt)
            self.metrics.requests.labels(plan.mode, "client_abort").inc()
            raise
        finally:
            target.active.discard(attempt.hook)
            target.inflight -= 1
            self.admission.wake()

    def _headers(self, path: str, data: bytes, signed: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **self.upstream_auth}
        if signed and self.secret is not None:
            headers.update(sign_request(self.secret, "POST", path, data))
        return headers

    async def _post(self, url: str, path: str, data: bytes, rid: str, signed: bool) -> aiohttp.ClientResponse:
        headers = {"X-Request-Id": rid, **self._headers(path, data, signed)}
        return await self.session.post(url, data=data, headers=headers)

    async def _relay_body(self, resp: aiohttp.ClientResponse, plan: Plan, attempt: _Attempt,
                          arrival: float) -> web.StreamResponse | str:
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as exc:
            resp.close()
            self.pools.report_failure(plan.target)
            return f"decode instance {plan.target.url} failed mid-response: {exc!r}"
        finally:
            resp.release()
        content_type = resp.headers.get("Content-Type", "application/json")
        if resp.status == 200 and "json" in content_type:
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                timings = pop_timings(obj)
                if timings is not None:
                    self.metrics.observe_timings(timings, plan.mode)
                    data = json.dumps(obj, ensure_ascii=False).encode()
        self.metrics.e2e.observe(time.monotonic() - arrival)
        self.metrics.requests.labels(plan.mode, "ok" if resp.status == 200 else f"http_{resp.status}").inc()
        return web.Response(body=data, status=resp.status, headers={"Content-Type": content_type})

    async def _relay_stream(self, request: web.Request, resp: aiohttp.ClientResponse, plan: Plan, rid: str,
                            attempt: _Attempt, wants_usage: bool, arrival: float) -> web.StreamResponse | str:
        """Relay the SSE stream. The client's response starts with the first event, not with upstream's headers:
        a decode instance that dies before sending anything (e.g. mid-handover) is retried elsewhere unseen."""
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache", "X-Request-Id": rid})
        sse = SSEFilter(client_wants_usage=wants_usage)
        first = True
        failure: str | None = None
        try:
            try:
                async for chunk in resp.content.iter_any():
                    data = sse.feed(chunk)
                    if first and sse.saw_content:
                        first = False
                        self.metrics.ttft.observe(time.monotonic() - arrival)
                    if data:
                        if not out.prepared:
                            await out.prepare(request)
                        await out.write(data)
                tail = sse.flush()
                if tail:
                    if not out.prepared:
                        await out.prepare(request)
                    await out.write(tail)
                if not sse.saw_done:
                    failure = "the decode instance closed the stream before [DONE]"
            except UPSTREAM_ERRORS as exc:
                failure = attempt.down_reason or f"lost the decode instance {plan.target.url}: {exc!r}"
                self.pools.report_failure(plan.target)
                self._abort_prefill(plan, rid)
            if failure is not None and not out.prepared:
                return failure  # the client has seen nothing: the caller retries on another decode instance
            if failure is not None:
                log.warning("request %s: %s", rid, failure)
                if sse.saw_error:  # upstream already told the client what went wrong
                    await out.write(b"data: [DONE]\n\n")
                else:
                    await out.write(error_event(failure))
            await out.write_eof()
        except ConnectionResetError:  # the client went away while we were writing
            self._on_client_gone(plan, rid, attempt)
            self.metrics.requests.labels(plan.mode, "client_abort").inc()
            return out
        finally:
            if failure is None and sse.saw_done:
                resp.release()  # clean end: the connection goes back to the pool
            else:
                resp.close()
        for timings in sse.timings:
            self.metrics.observe_timings(timings, plan.mode)
        self.metrics.e2e.observe(time.monotonic() - arrival)
        self.metrics.requests.labels(plan.mode, "ok" if failure is None else "upstream_error").inc()
        return out

    # ---- aborts ----

    def _on_client_gone(self, plan: Plan, rid: str, attempt: _Attempt) -> None:
        if attempt.resp is not None:
            attempt.resp.close()  # D sees its connection drop and aborts (and tells P)
        self._spawn(self._send_aborts([plan.target] + plan.prefill, rid))

    def _abort_prefill(self, plan: Plan, rid: str) -> None:
        if plan.prefill:
            self._spawn(self._send_aborts(plan.prefill, rid))

    async def _send_aborts(self, insts: list[Instance], rid: str) -> None:
        """Best effort: tell instances to drop `rid` (covers a D that died before telling its P)."""
        timeout = aiohttp.ClientTimeout(total=self.config.abort_timeout_s)

        data = json.dumps({"request_id": rid}).encode()

        async def one(inst: Instance) -> None:
            try:
                async with self.session.post(inst.url + "/v1/abort", data=data, timeout=timeout,
                                             headers=self._headers("/v1/abort", data, True)):
                    pass
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass

        await asyncio.gather(*(one(i) for i in insts))


async def start_router(config: RouterConfig) -> tuple[Router, web.AppRunner]:
    """Start serving on config.host:config.port; returns the router and the runner (call runner.cleanup())."""
    router = Router(config)
    runner = web.AppRunner(router.make_app(), handler_cancellation=True, access_log=None, **RUNNER_OPTIONS)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    return router, runner


def bound_port(runner: web.AppRunner) -> int:
    """The port actually bound (useful with port 0)."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
    raise RuntimeError("router is not listening")

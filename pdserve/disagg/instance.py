"""The instance-side HTTP half of the handover (server process).

Decode role: when the engine has reserved a request's blocks it emits a `reserved` event; the driver here asks the
router's prefill candidates, in order, to prefill and push the KV into those blocks (POST /internal/pd/prefill),
with bounded retries and backoff, and falls back to a local prefill when none can. Prefill role: that route runs
the prompt with an export destination and answers once the KV has landed on the decode instance.
Any role: POST /v1/abort aborts a request by the router's id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict

import aiohttp
from aiohttp import web

from pdserve.sampling_params import InvalidParameter, SamplingParams

log = logging.getLogger(__name__)

PREFILL_ROUTE = "/internal/pd/prefill"
ABORT_ROUTE = "/internal/pd/abort"


def role_options(role: str, kv_host: str = "127.0.0.1", kv_port: int = 0, transport: str = "auto",
                 lease_s: float = 30.0, fallback: str = "recompute", layerwise: str = "auto") -> dict:
    if role == "both":
        return {"role": "both"}
    return {"role": role, "lease_s": lease_s, "fallback": fallback, "layerwise": layerwise,
            "kv": {"host": kv_host, "port": kv_port, "transport": transport}}


class DecodeDriver:
    """Drives remote prefills for a decode instance's PD requests; owns nothing in the engine but the order."""

    def __init__(self, llm, connect_timeout_s: float = 2.0, prefill_timeout_s: float = 120.0, max_attempts: int = 3,
                 backoff_s: float = 0.05):
        self.llm = llm
        self.connect_timeout_s = connect_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.session: aiohttp.ClientSession | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.current: dict[str, str] = {}  # request id -> prefill url working on it
        llm.pd_event_handler = self.on_event
        llm.pd_abort_handler = self.on_abort

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60))

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        if self.session is not None:
            await self.session.close()

    def on_event(self, rid: str, ev: dict, stream) -> None:
        kind = ev.get("pd_event")
        t = self.llm.pd_timings.setdefault(rid, {"t_arrival": stream.state.arrival_time})
        if kind == "reserved":
            t["t_reserved"] = time.time()
            t["queue_s"] = t["t_reserved"] - t["t_arrival"]
            t["num_cached_tokens"] = ev.get("num_cached_tokens", 0)
            self.tasks[rid] = asyncio.get_running_loop().create_task(self._drive(rid, ev, stream))
        elif kind == "admitted":
            t["handover_s"] = ev.get("handover_s")
            t["first_token_s"] = time.time() - t["t_arrival"]
        elif kind == "fallback_local":
            t["fallback"] = "local"
            t["fallback_reason"] = ev.get("reason")

    async def _is_down(self, url: str) -> bool:
        return await _probe_down(self.session, url)

    def on_abort(self, rid: str) -> None:
        url = self.current.get(rid)
        if url is not None and self.session is not None:
            asyncio.get_running_loop().create_task(self._abort_remote(url, rid))

    async def _abort_remote(self, url: str, rid: str) -> None:
        try:
            async with self.session.post(url + ABORT_ROUTE, json={"request_id": rid},
                                         timeout=aiohttp.ClientTimeout(total=2)) as r:
                await r.read()
        except Exception:  # best effort: the lease frees the blocks anyway
            log.debug("abort of %s on %s failed", rid, url, exc_info=True)

    async def _drive(self, rid: str, ev: dict, stream) -> None:
        pd = stream.pd or {}
        urls = list(pd.get("prefill_urls") or [])[: self.max_attempts]
        params = stream.state.params
        body = {
            "request_id": rid,
            "prompt_token_ids": stream.prompt_token_ids,
            "sampling": _params_dict(params),
            "dest": {"agent": ev["agent"], "region": ev["region"], "block_ids": ev["block_ids"],
                     "start_block": ev["start_block"], "request_id": rid},
        }
        why = "no prefill instance was given"
        peer_done = True
        timings = self.llm.pd_timings.setdefault(rid, {})
        try:
            for attempt, url in enumerate(urls):
                if attempt:
                    await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)))
                self.current[rid] = url
                t0 = time.time()
                try:
                    async with self.session.post(
                        url.rstrip("/") + PREFILL_ROUTE, json=body,
                        timeout=aiohttp.ClientTimeout(total=self.prefill_timeout_s, sock_connect=self.connect_timeout_s),
                    ) as r:
                        data = await r.json(content_type=None)
                    if r.status == 200 and data.get("ok"):
                        timings["prefill_url"] = url
                        timings["prefill_s"] = (data.get("timings") or {}).get("prefill_s")
                        timings["prefill_http_s"] = time.time() - t0
                        timings["push_s"] = (data.get("timings") or {}).get("push_s")
                        return
                    why = f"{url} answered {r.status}: {data.get('error') if isinstance(data, dict) else data}"
                    peer_done = True  # it answered: it is not writing into our blocks any more
                except aiohttp.ClientConnectorError as e:
                    why, peer_done = f"{url} is unreachable: {e}", True
                except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as e:
                    why = f"{url} failed: {type(e).__name__}: {e}"
                    # a peer whose server no longer accepts connections has died: nothing of it writes any more
                    peer_done = isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
                        await self._is_down(url)
                    if not peer_done:
                        break  # it may still be writing: do not hand the same blocks to another peer
                log.warning("remote prefill of %s failed (attempt %d): %s", rid, attempt + 1, why)
            if rid in self.llm._streams:
                await self.llm.call("prefill_failed", rid, why, True, peer_done)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("driving the prefill of %s failed", rid)
        finally:
            self.current.pop(rid, None)
            self.tasks.pop(rid, None)
            if rid not in self.llm._streams:  # aborted meanwhile: the prefill peer is done with our blocks
                try:
                    await self.llm.call("release", rid)
                except Exception:
                    log.debug("release of %s failed", rid, exc_info=True)


async def _probe_down(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            await r.read()
        return False
    except aiohttp.ClientConnectorError:
        return True
    except (asyncio.TimeoutError, aiohttp.ClientError):
        return False


def _params_dict(p: SamplingParams) -> dict:
    d = asdict(p)
    d["max_tokens"] = 1
    return d


def add_pd_routes(app: web.Application, llm, role: str) -> None:
    """Routes every instance serves for the PD protocol."""
    exports: dict[str, str] = {}  # decode-side request id -> our engine request id

    async def prefill(request: web.Request) -> web.Response:
        if role == "decode":
            return web.json_response({"ok": False, "error": "this instance has role decode"}, status=400)
        try:
            body = await request.json()
            ids = [int(t) for t in body["prompt_token_ids"]]
            params = SamplingParams(**body["sampling"])
            dest = dict(body["dest"])
            remote_rid = str(body["request_id"])
        except (ValueError, KeyError, TypeError, InvalidParameter) as e:
            return web.json_response({"ok": False, "error": f"bad prefill order: {e}"}, status=400)
        rid = f"pd-{uuid.uuid4().hex[:12]}"
        exports[remote_rid] = rid
        first = None
        last = None
        t0 = time.time()
        try:
            async for out in llm.generate(rid, ids, params, pd={"export": dest}):
                if out.new_token_ids and first is None:
                    first = out.new_token_ids[0]
                    t_first = time.time()
                last = out
        except Exception as e:
            return web.json_response({"ok": False, "error": f"{type(e).__name__}: {e}"}, status=503)
        finally:
            exports.pop(remote_rid, None)
        if last is None or last.finish_reason == "error" or first is None:
            err = last.error if last is not None else "no output"
            return web.json_response({"ok": False, "error": err}, status=502)
        return web.json_response({"ok": True, "first_token": first,
                                  "timings": {"prefill_s": t_first - t0, "total_s": time.time() - t0}})

    async def abort_export(request: web.Request) -> web.Response:
        body = await request.json()
        rid = exports.get(str(body.get("request_id")))
        if rid is not None:
            await llm.abort(rid)
        return web.json_response({"ok": True, "found": rid is not None})

    async def abort_by_router_id(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            alias = str(body["request_id"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": {"message": "body must be {\"request_id\": ...}", "type":
                                                "invalid_request_error", "code": 400}}, status=400)
        rid = llm.aliases.get(alias) or (alias if alias in llm._streams else None)
        if rid is not None:
            await llm.abort(rid)
        return web.json_response({"ok": True, "found": rid is not None})

    app.router.add_post(PREFILL_ROUTE, prefill)
    app.router.add_post(ABORT_ROUTE, abort_export)
    app.router.add_post("/v1/abort", abort_by_router_id)


def pd_extra_routes(llm, role: str):
    """`extra_routes` for the server's app factory: the PD routes, and the decode driver's life cycle."""

    def install(app: web.Application) -> None:
        add_pd_routes(app, llm, role)
        if role == "decode":
            driver = DecodeDriver(llm)

            async def start(_app):
                await driver.start()

            async def stop(_app):
                await driver.close()

            app.on_startup.append(start)
            app.on_cleanup.append(stop)

    return install

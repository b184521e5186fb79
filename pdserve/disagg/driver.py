"""The decode instance's orders to prefill instances (server process).

When the engine reports `KVReserved`, the driver asks the router's prefill candidates, in order, to compute the
prompt and push its KV into the reserved blocks (POST /internal/pd/prefill), with bounded retries and backoff. If
none delivers, it tells the engine (`remote_prefill_failed`), which recomputes locally or fails the request, by
configuration. Only a candidate that answered (an error) or was never reached gives way to the next: an order that
was sent and got no answer is never handed to another prefill instance, since that one may still be pushing into
the reserved blocks (its engine and KV agents outlive its HTTP server; one-sided transports cannot be fenced): the
blocks are quarantined until the lease ends and the request recomputes here or fails. It owns the orders and the per-request handover timings (attached to the request's last output for
the router's per-phase metrics), nothing in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict

import aiohttp
import msgpack

from pdserve.config import KVTransferConfig
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.messages import KVAdmitted, KVFallback, KVReserved, PDEvent
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.signing import sign_request

log = logging.getLogger(__name__)

PREFILL_ROUTE = "/internal/pd/prefill"
ORDER_CONTENT_TYPE = "application/msgpack"  # prompt ids of 32k tokens: msgpack packs and parses them in well under 1 ms
ABORT_ROUTE = "/internal/pd/abort"
PUBLIC_TIMINGS = ("queue_s", "prefill_s", "handover_s", "first_token_s", "prefill_url", "fallback", "fallback_reason",
                  "num_cached_tokens", "push_s", "prefill_http_s", "transport", "push_start_s", "push_landed_s",
                  "admit_s")
MAX_TRANSPORT_NAME = 32


def handover_phases(ev: KVAdmitted) -> dict[str, float]:
    """The handover (prefill done -> admitted) in three: push_start_s (prefill done -> the prefill rank began the
    push), push_landed_s (-> the decode side took the notification: the copies and the notification) and admit_s
    (-> the engine admitted the request). Two hosts' clocks meet in the middle phase; none when the peer said no
    push time."""
    if ev.t_push is None or ev.t_notified is None:
        return {}
    return {"push_start_s": ev.t_push - ev.t_prefill_done, "push_landed_s": ev.t_notified - ev.t_push,
            "admit_s": ev.t_admitted - ev.t_notified}


def order_sampling(params: SamplingParams) -> dict:
    """The sampling parameters of the prefill side, which samples the first token only: max_tokens 1 (and
    min_tokens at most 1); logit_bias as [id, bias] pairs (msgpack maps of the order take string keys only)."""
    d = {**asdict(params), "max_tokens": 1, "min_tokens": min(params.min_tokens, 1)}
    if params.logit_bias is not None:
        d["logit_bias"] = [[int(k), float(v)] for k, v in params.logit_bias.items()]
    return d


def prefill_order(rid: str, prompt_token_ids: list[int], params: SamplingParams, ev: KVReserved) -> dict:
    """The body of POST /internal/pd/prefill."""
    d = ev.dest
    return {"request_id": rid, "prompt_token_ids": prompt_token_ids, "sampling": order_sampling(params),
            "dest": {"request_id": d.request_id, "block_ids": list(d.block_ids), "start_block": d.start_block,
                     "ranks": [{"agent": r.agent, "region": r.region, "heads": [r.head_start, r.head_stop]}
                               for r in d.ranks],
                     "layout": asdict(d.layout) if d.layout is not None else None,
                     "transport": asdict(d.transport) if d.transport is not None else None}}


class DecodeDriver:
    def __init__(self, llm: AsyncLLM, config: KVTransferConfig):
        self.llm = llm
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.current: dict[str, str] = {}  # request id -> the prefill url working on it
        # live requests whose prefill peer pushed the KV and answered: it writes none of their blocks any more
        self.delivered: set[str] = set()
        self.timings: dict[str, dict] = {}
        llm.add_event_listener(self.on_event)
        llm.add_output_hook(self.on_output)
        llm.add_closed_listener(self.on_stream_closed)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60))

    async def close(self) -> None:
        for t in list(self.tasks.values()):
            t.cancel()
        if self.session is not None:
            await self.session.close()

    # ---- the engine's events and outputs
    def on_event(self, ev: PDEvent) -> None:
        info = self.llm.request_info(ev.request_id)
        if info is None:
            if isinstance(ev, KVReserved):
                self._never_ordered(ev.request_id)
            return
        t = self.timings.setdefault(ev.request_id, {"t_arrival": info.arrival_time})
        if isinstance(ev, KVReserved):
            t["queue_s"] = ev.queue_s
            t["num_cached_tokens"] = ev.num_cached_tokens
            self.tasks[ev.request_id] = asyncio.get_running_loop().create_task(self._drive(ev))
        elif isinstance(ev, KVAdmitted):
            t["handover_s"] = ev.handover_s
            t["first_token_s"] = time.time() - t["t_arrival"]
            t.update(handover_phases(ev))
        elif isinstance(ev, KVFallback):
            t["fallback"] = "local"
            t["fallback_reason"] = ev.reason

    def on_output(self, rid: str, out: RequestOutput) -> None:
        if not out.finished:
            return
        self.delivered.discard(rid)
        t = self.timings.pop(rid, None)
        if t is not None:
            out.pd_timings = {k: t[k] for k in PUBLIC_TIMINGS if k in t}
            out.pd_timings.setdefault("fallback", None)

    def on_stream_closed(self, rid: str) -> None:
        """The request was aborted or its client went away: stop the prefill peer working on it (best effort)."""
        self.timings.pop(rid, None)
        url = self.current.get(rid)
        if url is not None:
            self._spawn_abort(url, rid)
        elif rid in self.delivered:
            # the peer is done, but the engine may not have taken the KV notification yet: then the abort (sent
            # before this listener runs) quarantined the blocks until the lease ends; free them now
            self.delivered.discard(rid)
            if self.llm.is_alive:
                self.llm.remote_prefill_done(rid)

    def _never_ordered(self, rid: str) -> None:
        """The client left while the engine reserved the request's blocks (its abort, sent before, crossed the
        reservation): the engine quarantined them until the lease ends, and no prefill peer was asked to write
        them. Free them now."""
        if self.llm.is_alive:
            self.llm.remote_prefill_done(rid)

    def _spawn_abort(self, url: str, rid: str) -> None:
        if self.session is not None:
            asyncio.get_running_loop().create_task(self._abort_remote(url, rid))

    def _signed(self, path: str, body: bytes, content_type: str) -> dict[str, str]:
        """Headers of an internal request: the prefill instance verifies them with the deployment secret."""
        headers = {"Content-Type": content_type}
        if self.config.secret is not None:
            headers.update(sign_request(self.config.secret, "POST", path, body))
        return headers

    async def _abort_remote(self, url: str, rid: str) -> None:
        body = json.dumps({"request_id": rid}).encode()
        try:
            async with self.session.post(url.rstrip("/") + ABORT_ROUTE, data=body,
                                         headers=self._signed(ABORT_ROUTE, body, "application/json"),
                                         timeout=aiohttp.ClientTimeout(total=2)) as r:
                await r.read()
        except Exception:  # best effort: the lease frees the blocks anyway
            log.debug("abort of %s on %s failed", rid, url, exc_info=True)

    # ---- the order
    async def _drive(self, ev: KVReserved) -> None:
        rid = ev.request_id
        info = self.llm.request_info(rid)
        if info is None or info.kv is None:
            self.tasks.pop(rid, None)
            if info is None:  # aborted before this task ran: no order went out
                self._never_ordered(rid)
            return
        cfg = self.config
        urls = list(info.kv.prefill_urls)[: cfg.order_max_attempts]
        payload = msgpack.packb(prefill_order(rid, info.prompt_token_ids, info.params, ev))  # 32k ids: ~0.1 MB
        why, peer_done = "no prefill instance was given", True
        timings = self.timings.setdefault(rid, {"t_arrival": info.arrival_time})
        try:
            for attempt, url in enumerate(urls):
                if attempt:
                    await asyncio.sleep(cfg.order_backoff_s * (2 ** (attempt - 1)))
                self.current[rid] = url
                t0 = time.time()
                try:
                    async with self.session.post(
                        url.rstrip("/") + PREFILL_ROUTE, data=payload,
                        headers=self._signed(PREFILL_ROUTE, payload, ORDER_CONTENT_TYPE),
                        timeout=aiohttp.ClientTimeout(total=cfg.order_timeout_s,
                                                      sock_connect=cfg.order_connect_timeout_s),
                    ) as r:
                        data = await r.json(content_type=None)
                    if r.status == 200 and isinstance(data, dict) and data.get("ok"):
                        got = data.get("timings") or {}
                        tr = got.get("transport")
                        timings.update(prefill_url=url, prefill_s=got.get("prefill_s"), push_s=got.get("push_s"),
                                       prefill_http_s=time.time() - t0,
                                       transport=tr if isinstance(tr, str) and len(tr) <= MAX_TRANSPORT_NAME else None)
                        if self.llm.request_info(rid) is not None:  # (else `finally` tells the engine)
                            self.delivered.add(rid)
                        return
                    err = data.get("error") if isinstance(data, dict) else data
                    why, peer_done = f"{url} answered {r.status}: {err}", True  # it answered: it writes no more
                except aiohttp.ClientConnectorError as e:
                    why, peer_done = f"{url} is unreachable: {e}", True
                except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as e:
                    # the order was sent and got no answer: the peer may still be pushing, even when its HTTP server
                    # is gone (its engine process and KV agents outlive it for a while; over a one-sided transport,
                    # mooncake, nixl, cuda_ipc, nothing here can fence their writes). Its blocks must not go to
                    # another peer: they wait out the lease, and the request recomputes here or fails.
                    why, peer_done = f"{url} failed: {type(e).__name__}: {e}", False
                    log.warning("remote prefill of %s failed (attempt %d, not retried elsewhere): %s", rid,
                                attempt + 1, why)
                    break
                log.warning("remote prefill of %s failed (attempt %d): %s", rid, attempt + 1, why)
            if self.llm.request_info(rid) is not None:
                self.llm.remote_prefill_failed(rid, why, peer_done)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("driving the prefill of %s failed", rid)
        finally:
            self.current.pop(rid, None)
            self.tasks.pop(rid, None)
            if self.llm.request_info(rid) is None and self.llm.is_alive:
                # aborted meanwhile: the prefill peer answered, so it is done with our blocks
                self.llm.remote_prefill_done(rid)

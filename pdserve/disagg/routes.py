"""The instance's PD routes (server process), installed by role:

- prefill role: POST /internal/pd/prefill computes a prompt and pushes its KV into a decode instance's reserved
  blocks (answering once the push ended; an order whose KV layout or transport differs from ours is refused with a
  400 naming both, before anything is computed), POST /internal/pd/abort stops such an order;
- decode role: the DecodeDriver that sends those orders;
- every role: POST /v1/abort aborts a request by the router's id.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import msgpack
from aiohttp import web

from pdserve.config import KV_PROTOCOLS, KV_TRANSPORTS, KVTransferConfig
from pdserve.disagg.driver import ABORT_ROUTE, PREFILL_ROUTE, DecodeDriver
from pdserve.disagg.heads import MAX_TP
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.messages import POOL_REGION, KVDestination, KVLayout, KVRankDest, KVTransportSpec
from pdserve.errors import EngineDead, PromptTooLong, QueueFull
from pdserve.protocol import error_body
from pdserve.sampling_params import InvalidParameter, SamplingParams
from pdserve.signing import verify_request
from pdserve.validation import ids_in_range

MAX_DEST_BLOCKS = 1 << 20


def unpack_order(raw: bytes) -> object:
    """A prefill order's msgpack body, with every size bounded before anything is allocated."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=1 << 16, max_bin_len=0,
                               max_array_len=MAX_DEST_BLOCKS * 16, max_map_len=64, max_ext_len=0)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise ValueError(f"not a msgpack order: {e}") from e


def parse_order(body: object) -> tuple[str, list[int], SamplingParams, KVDestination]:
    """The body of a prefill order; ValueError/TypeError/KeyError/InvalidParameter on anything malformed."""
    if not isinstance(body, dict):
        raise TypeError("the order must be a JSON object")
    ids = body["prompt_token_ids"]
    if not isinstance(ids, list) or not ids_in_range(ids, None):
        raise TypeError("prompt_token_ids must be a list of non-negative integers")
    sampling = body["sampling"]
    if not isinstance(sampling, dict):
        raise TypeError("sampling must be an object")
    bias = sampling.get("logit_bias")
    if bias is not None:  # [id, bias] pairs on the wire (pdserve.disagg.driver.order_sampling)
        if not isinstance(bias, list) or not all(isinstance(p, list) and len(p) == 2 for p in bias):
            raise TypeError("sampling.logit_bias must be a list of [token id, bias] pairs")
        sampling = {**sampling, "logit_bias": {k: v for k, v in bias}}
    params = SamplingParams(**sampling)
    d = body["dest"]
    if not isinstance(d, dict):
        raise TypeError("dest must be an object")
    blocks = d["block_ids"]
    if not isinstance(blocks, list) or len(blocks) > MAX_DEST_BLOCKS or not ids_in_range(blocks, None):
        raise TypeError("dest.block_ids must be a list of block numbers")
    lay = d.get("layout")
    layout = KVLayout(str(lay["dtype"]), int(lay["block_size"]), int(lay["num_layers"]), int(lay["num_kv_heads"]),
                      int(lay["head_dim"])) if isinstance(lay, dict) else None
    dest = KVDestination(str(d["request_id"]), tuple(blocks), _parse_ranks(d["ranks"]), int(d.get("start_block", 0)),
                         layout, _parse_transport(d.get("transport")))
    if dest.start_block < 0:
        raise ValueError("dest.start_block must be >= 0")
    return str(body["request_id"]), ids, params, dest


def _parse_ranks(ranks: object) -> tuple[KVRankDest, ...]:
    """dest.ranks: each decode rank's agent, region and KV heads [start, stop), in rank order."""
    if not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_TP:
        raise TypeError(f"dest.ranks must be a list of 1 to {MAX_TP} ranks")
    out = []
    for r in ranks:
        if not isinstance(r, dict):
            raise TypeError("each of dest.ranks must be an object")
        heads = r["heads"]
        if not (isinstance(heads, list) and len(heads) == 2 and all(
                isinstance(h, int) and not isinstance(h, bool) for h in heads) and 0 <= heads[0] < heads[1]):
            raise ValueError("a rank's heads must be [start, stop) with 0 <= start < stop")
        out.append(KVRankDest(str(r["agent"]), heads[0], heads[1], str(r.get("region", POOL_REGION))))
    return tuple(out)


def _parse_transport(tr: object) -> KVTransportSpec | None:
    """dest.transport: the decode instance's KVTransportSpec (None: it names none, e.g. an older instance)."""
    if tr is None:
        return None
    if not isinstance(tr, dict):
        raise TypeError("dest.transport must be an object")
    t, proto = tr["transport"], tr.get("protocol")
    if t not in KV_TRANSPORTS or (proto is not None and proto not in KV_PROTOCOLS):
        raise ValueError(f"dest.transport names no KV transport: {str(t)[:32]!r} over {str(proto)[:32]!r}")
    return KVTransportSpec(t, proto)


def order_mismatch(ours: dict, dest: KVDestination) -> str | None:
    """Why this instance (its connector's `describe()`) cannot push into `dest`: a different KV layout or a KV
    transport the decode instance does not run (None: it can)."""
    if dest.layout is not None and ours.get("layout") is not None:
        why = KVLayout(**ours["layout"]).mismatch(dest.layout)
        if why is not None:
            return why
    if dest.transport is not None and ours.get("transport") is not None:
        return KVTransportSpec(**ours["transport"]).mismatch(dest.transport)
    return None


def _json_error(message: str, status: int) -> web.Response:
    return web.json_response({"ok": False, **error_body(message, "invalid_request_error" if status < 500
                                                        else "server_error")}, status=status)


def add_prefill_routes(app: web.Application, llm: AsyncLLM, config: KVTransferConfig) -> None:
    orders: dict[str, str] = {}  # decode-side request id -> our engine request id

    async def prefill(request: web.Request) -> web.Response:
        raw = await request.read()
        verify_request(config.secret, request, raw)  # 401 unless a decode instance of this deployment signed it
        try:
            remote_rid, ids, params, dest = parse_order(unpack_order(raw))
        except (ValueError, KeyError, TypeError, InvalidParameter) as e:
            return _json_error(f"bad prefill order: {e}", 400)
        why = order_mismatch(llm.info.get("kv") or {}, dest)
        if why is not None:  # refused before the prompt is computed: the decode side falls back at once
            return _json_error(why, 400)
        rid = f"pd-{uuid.uuid4().hex[:12]}"
        orders[remote_rid] = rid
        t0 = time.time()
        try:
            done = await llm.export(rid, ids, params, dest, config.order_timeout_s)
        except (PromptTooLong, InvalidParameter, ValueError) as e:
            return _json_error(f"{type(e).__name__}: {e}", 400)
        except (QueueFull, EngineDead, TimeoutError) as e:
            return _json_error(f"{type(e).__name__}: {e}", 503)
        finally:
            orders.pop(remote_rid, None)
        if done.error is not None:
            return _json_error(done.error, 502)
        return web.json_response({"ok": True, "first_token": done.first_token, "timings": {
            "prefill_s": (done.t_prefill_done or t0) - t0, "push_s": done.push_s, "total_s": time.time() - t0,
            "bytes": done.nbytes, "transport": done.transport}})

    async def abort_order(request: web.Request) -> web.Response:
        raw = await request.read()
        verify_request(config.secret, request, raw)
        try:
            body = json.loads(raw)
            rid = orders.get(str(body["request_id"]))
        except (ValueError, KeyError, TypeError):
            return _json_error("body must be {\"request_id\": ...}", 400)
        if rid is not None:
            await llm.abort(rid)
        return web.json_response({"ok": True, "found": rid is not None})

    app.router.add_post(PREFILL_ROUTE, prefill)
    app.router.add_post(ABORT_ROUTE, abort_order)


def add_abort_route(app: web.Application, llm: AsyncLLM, secret: bytes | None) -> None:
    async def abort_by_router_id(request: web.Request) -> web.Response:
        raw = await request.read()
        verify_request(secret, request, raw)  # only the router (or a process holding the secret) aborts by id
        try:
            body = json.loads(raw)
            alias = str(body["request_id"])
        except (ValueError, KeyError, TypeError):
            return _json_error("body must be {\"request_id\": ...}", 400)
        rid = find_by_router_id(llm, alias)
        if rid is not None:
            await llm.abort(rid)
        return web.json_response({"ok": True, "found": rid is not None})

    app.router.add_post("/v1/abort", abort_by_router_id)


def find_by_router_id(llm: AsyncLLM, router_id: str) -> str | None:
    """The engine request the router knows as `router_id` (its `pd.request_id`, or our own id)."""
    if llm.request_info(router_id) is not None:
        return router_id
    for rid in llm.request_ids():
        info = llm.request_info(rid)
        if info is not None and info.kv is not None and info.kv.router_request_id == router_id:
            return rid
    return None


def pd_routes(llm: AsyncLLM, config: KVTransferConfig) -> Callable[[web.Application], None]:
    """`extra_routes` for the server's app factory: the routes of the instance's role, and the decode driver's life
    cycle."""

    def install(app: web.Application) -> None:
        add_abort_route(app, llm, config.secret)
        if config.role == "prefill":
            add_prefill_routes(app, llm, config)
        if config.role == "decode":
            driver = DecodeDriver(llm, config)

            async def start(_app):
                await driver.start()

            async def stop(_app):
                await driver.close()

            app.on_startup.append(start)
            app.on_cleanup.append(stop)

    return install


"""The decode (import) side of the KV handover: tell where a reserved request's KV should land, and report the
prefill peers' notifications, validated at the edge, to the engine.

The scheduler reserves the blocks (after its own prefix-cache lookup, so only missing blocks travel) and admits the
request when `take_arrivals` reports its KV landed; this side only describes destinations (`reserved`) and turns
the agent's notifications into `KVArrival`s. A notification that is malformed or names a first token outside the
vocabulary is dropped and logged with its peer: nothing a peer sends can fail an engine step.
"""

from __future__ import annotations

import logging
import math
import queue
from collections.abc import Callable
from dataclasses import asdict

from pdserve.config import KVTransferConfig
from pdserve.disagg.agent import start_agent
from pdserve.engine.kv_connector import KVArrival, KVConnector, KVPool
from pdserve.engine.messages import POOL_REGION, KVDestination, KVReserved
from pdserve.engine.request import Request

log = logging.getLogger(__name__)

MAX_REQUEST_ID = 256
MAX_TOP_LOGPROBS = 20


class DecodeImporter(KVConnector):
    role = "decode"

    def __init__(self, config: KVTransferConfig, pool: KVPool, wake: Callable[[], None], agent=None):
        self.config = config
        self.pool = pool
        self.wake = wake
        self.agent, self.region_id = start_agent(config, pool, agent)
        self._arrivals: queue.SimpleQueue[KVArrival] = queue.SimpleQueue()
        self.num_dropped = 0
        self.agent.on_notification(self._on_notification)

    def describe(self) -> dict:
        return {"role": self.role, "agent": self.agent.address, "region": POOL_REGION,
                "block_bytes": self.pool.block_bytes, "block_size": self.pool.block_size,
                "layout": asdict(self.pool.layout)}

    def has_events(self) -> bool:
        return not self._arrivals.empty()

    def reserved(self, req: Request) -> KVReserved:
        bs = self.pool.block_size
        start = req.num_cached_tokens // bs
        nb = (req.num_prompt_tokens + bs - 1) // bs
        blocks = req.block_ids[start:nb]
        # only these blocks, only for this request, until its lease ends (also when none travel: the notification
        # that carries the first token needs the grant too)
        self.agent.grant_blocks(req.request_id, POOL_REGION, blocks, self.pool.block_bytes, "w", req.kv_deadline)
        dest = KVDestination(self.agent.address, req.request_id, tuple(blocks), start, POOL_REGION, self.pool.layout)
        return KVReserved(req.request_id, dest, req.num_cached_tokens, req.t_reserved,
                          req.t_reserved - req.arrival_time)

    def _on_notification(self, n) -> None:  # agent thread
        try:
            arrival = parse_arrival(n, self.pool.vocab_size)
        except (ValueError, TypeError, KeyError) as e:
            self.num_dropped += 1
            log.warning("dropped a malformed KV notification from %s: %s", getattr(n, "peer", "?"), e)
            return
        self._arrivals.put(arrival)
        self.wake()

    def forget(self, request_id: str) -> None:
        self.agent.revoke(request_id)

    def take_arrivals(self) -> list[KVArrival]:
        out = []
        while True:
            try:
                out.append(self._arrivals.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> dict:
        return {"dropped_notifications": self.num_dropped}

    def close(self) -> None:
        try:
            self.agent.close()
        except Exception:  # closing on the way out: nothing left to tell
            log.debug("agent close failed", exc_info=True)


def parse_arrival(n, vocab_size: int) -> KVArrival:
    """A notification as a KVArrival; raises ValueError/TypeError/KeyError on anything malformed. The request is the
    one the notification's key names: the agent checked that key against a live grant admitting the sender."""
    rid = n.key
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        raise ValueError("the notification names no request (key)")
    error = getattr(n, "error", None)
    if error is not None:
        return KVArrival(rid, None, None, None, str(error)[:1000])
    payload = n.payload_dict()
    if payload is None:
        raise TypeError("payload is not a map")
    tok = payload["first_token"]
    if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
        raise ValueError(f"first_token {tok!r} is not a token id of this model")
    t_done = payload["t_prefill_done"]
    if isinstance(t_done, bool) or not isinstance(t_done, (int, float)) or not math.isfinite(t_done):
        raise ValueError("t_prefill_done must be a finite number")
    return KVArrival(rid, tok, _parse_logprob(payload.get("logprob"), vocab_size), float(t_done))


def _parse_logprob(lp, vocab_size: int) -> tuple | None:
    if lp is None:
        return None
    chosen, top = lp
    if not isinstance(chosen, (int, float)) or not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS:
        raise ValueError("malformed logprob")
    pairs = []
    for t, v in top:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size or not isinstance(v, (int, float)):
            raise ValueError("malformed top logprobs")
        pairs.append((t, float(v)))
    return (float(chosen), pairs)

"""The decode (import) side of the KV handover: tell where a reserved request's KV should land on each rank, and
report the request's arrival once the KV of every source rank landed on every rank.

The scheduler reserves the blocks (after its own prefix-cache lookup, so only missing blocks travel; the same block
ids on every rank) and admits the request when `take_arrivals` reports its KV landed; this side grants those blocks
on every rank's KV agent (`pdserve.disagg.rank_kv`, through the executor's collective_rpc), describes the
destination (each rank's agent and KV heads), and counts the validated notifications the ranks report: one per
(prefill rank, decode rank) pair of the push plan (`pdserve.disagg.heads.push_plan` for the prefill instance's
size), the one from prefill rank 0 to decode rank 0 carrying the first token. A notification that is malformed is
dropped and counted; nothing a peer sends can fail an engine step. The destination names this instance's KV
transport (`KVTransportSpec`: the prefill side refuses a mismatch before computing anything); every pair's
notification names the transport that carried it, counted per (transport, prefill agent, outcome) for /load and
/metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pdserve.config import KVTransferConfig
from pdserve.disagg.agent import transfer_counts, transport_spec
from pdserve.disagg.export_side import close_ranks
from pdserve.disagg.heads import head_ranges, push_plan
from pdserve.disagg.rank_kv import RankDropped, RankNotified, kv_grant, kv_revoke, kv_start
from pdserve.engine.executor import Executor
from pdserve.engine.kv_connector import KVArrival, KVConnector, KVPool
from pdserve.engine.messages import POOL_REGION, KVDestination, KVRankDest, KVReserved
from pdserve.engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class Landing:
    """The notifications of one reserved request so far."""

    src_tp: int | None = None
    pairs: set[tuple[int, int]] = field(default_factory=set)  # (prefill rank, decode rank)
    head: RankNotified | None = None  # the pair (0, 0): the first token


class DecodeImporter(KVConnector):
    role = "decode"

    def __init__(self, config: KVTransferConfig, pool: KVPool, wake: Callable[[], None], ranks: Executor,
                 agent=None):
        if agent is not None and ranks.size > 1:
            raise ValueError("an in-process KV agent serves tensor-parallel size 1 only")
        self.config = config
        self.pool = pool
        self.wake = wake
        self.ranks = ranks
        self.spec = transport_spec(config)
        infos = ranks.collective_rpc(kv_start, config, agent)
        self.dest_ranks = tuple(KVRankDest(i["agent"], i["heads"][0], i["heads"][1]) for i in infos)
        self._plans: dict[int, frozenset[tuple[int, int]]] = {}  # prefill size -> the pairs a push has
        self._landing: dict[str, Landing] = {}
        self.num_dropped = 0
        # (transport, prefill agent address, ok | failed) -> pairs' notifications; engine thread only (take_arrivals)
        self.transfers: dict[tuple[str, str, str], int] = {}

    def describe(self) -> dict:
        return {"role": self.role, "agent": self.dest_ranks[0].agent, "agents": [r.agent for r in self.dest_ranks],
                "region": POOL_REGION, "block_bytes": self.pool.block_bytes, "block_size": self.pool.block_size,
                "layout": asdict(self.pool.layout), "transport": asdict(self.spec), "tp": self.ranks.size}

    def has_events(self) -> bool:
        return self.ranks.has_reports()

    def reserved(self, req: Request) -> KVReserved:
        bs = self.pool.block_size
        start = req.num_cached_tokens // bs
        nb = (req.num_prompt_tokens + bs - 1) // bs
        blocks = list(req.block_ids[start:nb])
        # only these blocks, only for this request, until its lease ends, on every rank
        self.ranks.collective_rpc(kv_grant, req.request_id, blocks, req.kv_deadline)
        self._landing[req.request_id] = Landing()
        dest = KVDestination(req.request_id, tuple(blocks), self.dest_ranks, start, self.pool.layout, self.spec)
        return KVReserved(req.request_id, dest, req.num_cached_tokens, req.t_reserved,
                          req.t_reserved - req.arrival_time)

    def _pairs(self, src_tp: int) -> frozenset[tuple[int, int]]:
        pairs = self._plans.get(src_tp)
        if pairs is None:
            own = [(r.head_start, r.head_stop) for r in self.dest_ranks]
            runs = push_plan(head_ranges(self.pool.total_kv_heads, src_tp), own)
            pairs = self._plans[src_tp] = frozenset((r.src, r.dst) for r in runs)
        return pairs

    def take_arrivals(self) -> list[KVArrival]:
        out = []
        for r in self.ranks.take_reports():
            if isinstance(r, RankDropped):
                self.num_dropped += 1
                continue
            if not isinstance(r, RankNotified):
                log.debug("decode side: ignored a %s", type(r).__name__)
                continue
            k = (r.transport or "unknown", r.peer, "ok" if r.error is None else "failed")
            self.transfers[k] = self.transfers.get(k, 0) + 1
            h = self._landing.get(r.request_id)
            if h is None:  # not waiting (any more): admitted, failed or aborted, and its grants revoked
                continue
            arrival = self._land(h, r)
            if arrival is not None:
                del self._landing[r.request_id]
                out.append(arrival)
        return out

    def _land(self, h: Landing, r: RankNotified) -> KVArrival | None:
        """The request's arrival once every pair landed (or its failure), else None."""
        if r.error is not None:
            # the other pairs of a push over several ranks may still be writing: their blocks wait out the lease
            alone = r.src_tp == 1 and len(self.dest_ranks) == 1
            return KVArrival(r.request_id, None, None, None, f"rank {r.rank}: {r.error}", peer_done=alone)
        if h.src_tp is None:
            h.src_tp = r.src_tp
        try:
            pairs = self._pairs(r.src_tp)
        except ValueError as e:
            pairs, why = frozenset(), str(e)
        else:
            why = None
        if why is None and r.src_tp != h.src_tp:
            why = f"notifications name prefill sizes {h.src_tp} and {r.src_tp}"
        if why is None and (r.src, r.rank) not in pairs:
            why = f"prefill rank {r.src} of {r.src_tp} sends nothing to rank {r.rank}"
        if why is not None:
            self.num_dropped += 1
            log.warning("decode side: dropped a KV notification for %s: %s", r.request_id, why)
            return None
        h.pairs.add((r.src, r.rank))
        if (r.src, r.rank) == (0, 0):
            h.head = r
        if h.head is None or h.pairs != pairs:
            return None
        return KVArrival(r.request_id, h.head.first_token, h.head.logprob, h.head.t_prefill_done,
                         t_push=h.head.t_push, t_notified=r.t_notified)

    def forget(self, request_id: str) -> None:
        self._landing.pop(request_id, None)
        self.ranks.collective_rpc(kv_revoke, request_id)

    def stats(self) -> dict:
        return {"dropped_notifications": self.num_dropped, "waiting_for_kv": len(self._landing),
                "transfers": transfer_counts(self.transfers)}

    def close(self) -> None:
        close_ranks(self.ranks)

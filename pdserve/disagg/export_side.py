"""The prefill (export) side of the KV handover: push a computed prompt's KV into the blocks a decode instance
reserved on each of its ranks, then notify them, the first token going to decode rank 0.

The engine asks and hands work; this side only moves bytes, through one KV agent per tensor-parallel rank
(`pdserve.disagg.rank_kv.RankKV`, driven with the executor's collective_rpc): `on_added` has every rank dial the
decode ranks it sends to while the prompt computes, `layer_hook` (over slow transports) arms every rank to send each
layer's runs as soon as that layer's attention wrote them, `start_export` has every rank push the rest and notify,
`push_ahead` has every rank send the full blocks of a long prompt's chunks before its last while the next chunk
computes (so only the last chunk's blocks move after the prefill), `take_finished_exports` reports a push's end once
every rank's share ended (the scheduler then frees the blocks),
`cancel_export` stops a push whose lease ran out on every rank.

Each rank's agent fixes the transport per decode rank it sends to when it dials it (`rank_kv.PeerLink`), names it on
every push, and decides per peer whether pushes go layer by layer (--kv-layerwise auto: over tcp); the orders are
checked before anything is computed: a destination whose KV layout or transport (`KVTransportSpec`) differs from
ours is refused. Handovers are counted per (transport, decode agent, outcome), one per (prefill rank, decode rank)
pair of a push, for /load and /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict

from pdserve.config import KVTransferConfig
from pdserve.disagg.agent import transfer_counts, transport_spec
from pdserve.disagg.heads import MAX_TP, head_ranges
from pdserve.disagg.rank_kv import (
    RankPushed,
    kv_abandon,
    kv_arm_layers,
    kv_cancel,
    kv_close,
    kv_dial,
    kv_push,
    kv_push_ahead,
    kv_start,
    layerwise_for,
)
from pdserve.engine.executor import Executor
from pdserve.engine.kv_connector import ExportResult, KVConnector, KVPool
from pdserve.engine.messages import POOL_REGION, KVDestination, KVTransportSpec
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ExportStart, ScheduledBatch

log = logging.getLogger(__name__)


def num_prompt_blocks(req: Request, block_size: int) -> int:
    return (req.num_prompt_tokens + block_size - 1) // block_size


def check_destination(dest: KVDestination, ours: KVPool, spec: KVTransportSpec | None = None) -> None:
    """Raise ValueError unless `dest` is a decode instance we can push into: the same global layout, a KV transport
    ours agrees with (`spec`), and ranks that split the model's KV heads as a pdserve instance of that size does."""
    why = ours.layout.mismatch(dest.layout) if dest.layout is not None else None
    if why is None and spec is not None and dest.transport is not None:
        why = spec.mismatch(dest.transport)
    if why is not None:
        raise ValueError(why)
    if not 1 <= len(dest.ranks) <= MAX_TP:
        raise ValueError(f"the destination names {len(dest.ranks)} ranks")
    got = [(r.head_start, r.head_stop) for r in dest.ranks]
    if got != head_ranges(ours.total_kv_heads, len(dest.ranks)):
        raise ValueError(f"the destination's ranks hold KV heads {got}, not those of a {len(dest.ranks)}-rank "
                         f"instance of this model ({ours.total_kv_heads} KV heads)")


class PrefillExporter(KVConnector):
    role = "prefill"

    def __init__(self, config: KVTransferConfig, pool: KVPool, wake: Callable[[], None], ranks: Executor,
                 agent=None):
        if agent is not None and ranks.size > 1:
            raise ValueError("an in-process KV agent serves tensor-parallel size 1 only")
        self.config = config
        self.pool = pool
        self.wake = wake
        self.ranks = ranks
        self.agents = [i["agent"] for i in ranks.collective_rpc(kv_start, config, agent)]
        self.spec = transport_spec(config)
        self.layerwise = config.layerwise  # KV_LAYERWISE; auto: decided per decode peer by its transport
        self._pushes: dict[str, list[RankPushed]] = {}  # request -> the ranks' ends of its push so far
        self._failed: list[ExportResult] = []  # pushes that never started
        self.num_layerwise = 0
        self.num_ahead = 0  # exports whose blocks went (in part) ahead of the prompt's last chunk
        # (transport, decode agent address, ok | failed) -> pairs pushed; engine thread only (take_finished_exports)
        self.transfers: dict[tuple[str, str, str], int] = {}

    def describe(self) -> dict:
        return {"role": self.role, "agent": self.agents[0], "agents": self.agents, "region": POOL_REGION,
                "block_bytes": self.pool.block_bytes, "block_size": self.pool.block_size,
                "layout": asdict(self.pool.layout), "transport": asdict(self.spec), "layerwise": self.layerwise,
                "tp": self.ranks.size}

    def has_events(self) -> bool:
        return bool(self._failed) or self.ranks.has_reports()

    # ---- connections: every rank dials the decode ranks it sends to, while the prompt computes
    def on_added(self, req: Request) -> None:
        dest = req.kv_export.dest
        check_destination(dest, self.pool, self.spec)
        self.ranks.collective_rpc(kv_dial, dest)

    # ---- layer by layer, during the forward pass that completes the prompt
    def layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        if self.layerwise == "off" or (self.layerwise == "auto" and self.config.transport != "auto" and
                                       not layerwise_for("auto", self.config.transport)):
            return None  # no peer's pushes go layer by layer: no need to ask the ranks
        bs = self.pool.block_size
        items = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            ex = req.kv_export
            if ex is None or req.num_computed_tokens + n != req.num_tokens:
                continue
            items.append((req.request_id, ex.dest, req.block_ids[ex.dest.start_block:num_prompt_blocks(req, bs)]))
        if not items:
            return None
        armed = self.ranks.collective_rpc(kv_arm_layers, items, self.layerwise)
        hook = self.ranks.driver.take_after_layer()
        if hook is None and any(armed):
            return _layer_by_layer  # rank 0 sends nothing itself, but the step must run layer by layer everywhere
        return hook

    # ---- ahead of the push: the full blocks of a long prompt's chunks before its last
    def push_ahead(self, batch: ScheduledBatch) -> list[tuple[Request, int]]:
        if not self.config.push_ahead or self.layerwise == "on":  # ("on": every pair goes layer by layer)
            return []
        bs = self.pool.block_size
        items, out = [], []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            ex = req.kv_export
            end = req.num_computed_tokens + n
            if ex is None or end >= req.num_tokens:  # the last chunk: pushed after it (or layer by layer in it)
                continue
            dest = ex.dest
            hi = min(end // bs - dest.start_block, len(dest.block_ids))  # full destination blocks computed
            if hi <= req.kv_pushed_blocks:
                continue
            self.num_ahead += req.kv_pushed_blocks == 0
            items.append((req.request_id, dest, req.block_ids[dest.start_block:dest.start_block + hi]))
            out.append((req, hi))
        if items:
            self.ranks.collective_rpc(kv_push_ahead, items, self.layerwise)
        return out

    def abandon_export(self, request_id: str) -> None:
        self._pushes[request_id] = []
        self.ranks.collective_rpc(kv_abandon, request_id)

    # ---- the push, after the first token was sampled
    def start_export(self, ex: ExportStart) -> None:
        req, dest = ex.req, ex.req.kv_export.dest
        rid = req.request_id
        src = req.block_ids[dest.start_block:num_prompt_blocks(req, self.pool.block_size)]
        if len(src) != len(dest.block_ids):
            self._failed.append(ExportResult(rid, f"destination has {len(dest.block_ids)} blocks for {len(src)} "
                                                  f"blocks of KV"))
            self.wake()
            return
        notif = {"request_id": dest.request_id, "first_token": ex.first_token,
                 "logprob": [ex.logprob[0], [list(t) for t in ex.logprob[1]]] if ex.logprob else None,
                 "t_prefill_done": ex.t_prefill_done, "num_blocks": len(src)}
        self._pushes[rid] = []
        # every rank's writes end within what is left of the push's lease (the scheduler cancels it at the end)
        self.ranks.collective_rpc(kv_push, rid, dest, list(src), notif, req.kv_deadline)

    def take_finished_exports(self) -> list[ExportResult]:
        out, self._failed = self._failed, []
        for r in self.ranks.take_reports():
            if not isinstance(r, RankPushed) or r.request_id not in self._pushes:
                log.debug("prefill side: ignored a %s", type(r).__name__)
                continue
            ends = self._pushes[r.request_id]
            ends.append(r)
            for pair in r.pairs:
                k = (pair.transport, pair.peer, "ok" if pair.error is None else "failed")
                self.transfers[k] = self.transfers.get(k, 0) + 1
            if len(ends) < self.ranks.size:
                continue
            del self._pushes[r.request_id]
            errors = [e.error for e in sorted(ends, key=lambda e: e.rank) if e.error is not None]
            if errors:
                tr = next((e.transport for e in sorted(ends, key=lambda e: e.rank) if e.transport), None)
                out.append(ExportResult(r.request_id, errors[0], transport=tr))
                continue
            transport = next((e.transport for e in sorted(ends, key=lambda e: e.rank) if e.transport != "none"),
                             "none")
            layerwise = any(e.layerwise for e in ends)
            self.num_layerwise += layerwise
            out.append(ExportResult(r.request_id, None, max(e.seconds for e in ends), sum(e.nbytes for e in ends),
                                    transport, layerwise))
        return out

    def cancel_export(self, request_id: str) -> None:
        self.ranks.collective_rpc(kv_cancel, request_id)

    def stats(self) -> dict:
        return {"layerwise_exports": self.num_layerwise, "ahead_exports": self.num_ahead,
                "pushes_in_flight": len(self._pushes),
                "transfers": transfer_counts(self.transfers)}

    def close(self) -> None:
        close_ranks(self.ranks)


def _layer_by_layer(layer: int) -> None:
    """Rank 0's per-layer callback when only other ranks send during the step: it makes rank 0 plan a step that
    calls back after every layer (the other ranks follow rank 0's plan), and has nothing of its own to send."""


def close_ranks(ranks: Executor) -> None:
    """Stop every rank's agent (rank 0's at least, when the other ranks are gone)."""
    try:
        ranks.collective_rpc(kv_close)
    except Exception:  # closing on the way out (a rank may be dead): rank 0's agent still stops
        log.debug("closing the ranks' KV agents failed", exc_info=True)
        kv_close(ranks.driver)

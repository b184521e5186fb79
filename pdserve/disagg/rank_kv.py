"""One tensor-parallel rank's end of the KV handover: its KV agent over its own pool (its KV heads, the block ids
every rank shares), and what moves through it. One `RankKV` per rank, kept in that rank's Worker
(`worker.extras["kv"]`) and driven by rank 0's connector through the executor's `collective_rpc` with the `kv_*`
functions below; what happens later on the agent's thread (a notification landed, a push ended) goes back to
rank 0 as a typed report (`Worker.report`: `RankNotified`, `RankDropped`, `RankPushed`).

A rank owns its agent, its connections to peers and its pushes in flight; rank 0's connector owns the request-level
bookkeeping (which pairs of a push landed, which ranks finished pushing). Decode side: `grant` the reserved blocks
on this rank, validate notifications at the edge (`parse_notification`). Prefill side: send this rank's head runs
(`pdserve.disagg.heads.push_plan`) to the decode ranks that hold those heads, whole blocks after the prefill or one
run per head and layer during it, each pair ending with a notification to its destination rank.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.config import KVTransferConfig
from pdserve.disagg.agent import start_agent
from pdserve.disagg.heads import MAX_TP, HeadRun, head_ranges, push_plan
from pdserve.engine.kv_connector import KVPool
from pdserve.engine.messages import POOL_REGION, KVDestination
from pdserve.kv.descs import XferList
from pdserve.model.parallel import kv_head_range

log = logging.getLogger(__name__)

MAX_REQUEST_ID = 256
MAX_TOP_LOGPROBS = 20


# ---- reports (rank -> rank 0)


@dataclass(frozen=True)
class RankNotified:
    """Decode side: a validated notification reached rank `rank`: the KV that source rank `src` (of `src_tp`) sent
    it for the request has landed, or (`error`) that push failed. Only the pair (0 -> 0) carries the first token."""

    rank: int
    request_id: str
    src: int
    src_tp: int
    first_token: int | None = None
    logprob: tuple | None = None
    t_prefill_done: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class RankDropped:
    """Decode side: rank `rank` dropped a malformed notification."""

    rank: int
    peer: str
    why: str


@dataclass(frozen=True)
class RankPushed:
    """Prefill side: rank `rank`'s share of a push ended (`error` None: its KV and notifications landed)."""

    rank: int
    request_id: str
    error: str | None
    seconds: float = 0.0
    nbytes: int = 0
    transport: str | None = None


# ---- one rank


def rank_pool(worker) -> KVPool:
    """What this rank's agent registers and moves: its pool, over its own KV heads."""
    kv = worker.runner.kv_cache
    total = int(worker.hf_config.num_key_value_heads)
    heads = kv_head_range(total, worker.tp)
    bb = kv[0].numel() * kv.element_size()
    return KVPool(kv, worker.runner.block_size, bb, int(kv.shape[0]) - 1, int(worker.hf_config.vocab_size),
                  kv.device, total, heads)


class RankKV:
    def __init__(self, config: KVTransferConfig, pool: KVPool, rank: int, tp_size: int,
                 report: Callable[[object], None], agent=None):
        self.config = config
        self.pool = pool
        self.rank = rank
        self.tp_size = tp_size
        self.report = report
        if config.port and agent is None:  # a fixed port: rank r listens on port + r
            config = replace(config, port=config.port + rank)
        self.agent, self.region_id = start_agent(config, pool, agent)
        self.head_bytes = pool.num_layers * pool.run_bytes  # one head of one block, every layer, K and V
        self.src_ranges = head_ranges(pool.total_kv_heads, tp_size)
        self._plans: dict[tuple, list[HeadRun]] = {}
        self._connects: dict[str, concurrent.futures.Future] = {}  # decode agent address -> dial (peer name)
        self._peers: dict[str, str] = {}  # decode agent address -> connected peer name
        self._layer_futs: dict[str, list[tuple[HeadRun, concurrent.futures.Future]]] = {}
        self._pushes: dict[str, concurrent.futures.Future] = {}
        self.agent.on_peer_lost(self._on_peer_lost)
        self.agent.on_notification(self._on_notification)

    @property
    def address(self) -> str:
        return self.agent.address

    # ---- decode side
    def grant(self, request_id: str, block_ids: list[int], deadline: float) -> None:
        """Only these blocks of this rank's pool, only for this request, until its lease ends (also when none
        travel: the notifications need the grant too)."""
        self.agent.grant_blocks(request_id, POOL_REGION, block_ids, self.pool.block_bytes, "w", deadline)

    def revoke(self, request_id: str) -> None:
        self.agent.revoke(request_id)

    def _on_notification(self, n) -> None:  # agent thread
        try:
            self.report(parse_notification(n, self.rank, self.pool.vocab_size))
        except (ValueError, TypeError, KeyError) as e:
            peer = str(getattr(n, "peer", "?"))
            log.warning("rank %d dropped a malformed KV notification from %s: %s", self.rank, peer, e)
            self.report(RankDropped(self.rank, peer, str(e)[:200]))

    # ---- prefill side: connections, one per decode rank's agent, made once and reused
    def _on_peer_lost(self, peer: str, why: str) -> None:  # agent thread
        self._peers = {a: p for a, p in self._peers.items() if p != peer}

    def plan(self, dest: KVDestination) -> list[HeadRun]:
        """This rank's runs of a push into `dest`."""
        key = tuple((r.head_start, r.head_stop) for r in dest.ranks)
        runs = self._plans.get(key)
        if runs is None:
            runs = self._plans[key] = [r for r in push_plan(self.src_ranges, list(key)) if r.src == self.rank]
        return runs

    def dial(self, dest: KVDestination) -> None:
        for run in self.plan(dest):
            address = dest.ranks[run.dst].agent
            f = self._connects.get(address)
            if f is None or (f.done() and (f.cancelled() or f.exception() is not None)):
                self._connects[address] = self.agent.submit(self._peer_for(address))

    async def _peer_for(self, address: str) -> str:
        peer = self._peers.get(address)
        if peer is None:
            peer = await self.agent.agent.connect(address)
            self._peers[address] = peer
        return peer

    def _connected(self, address: str) -> str | None:
        f = self._connects.get(address)
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return None
        return f.result()

    def _offsets(self, run: HeadRun, dest: KVDestination, src_blocks, dst_blocks) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of the run's first head in each source and destination block."""
        d = dest.ranks[run.dst]
        src = np.asarray(src_blocks, dtype=np.int64) * self.pool.block_bytes + \
            (run.lo - self.pool.head_range[0]) * self.head_bytes
        dst = np.asarray(dst_blocks, dtype=np.int64) * (d.num_heads * self.head_bytes) + \
            (run.lo - d.head_start) * self.head_bytes
        return src, dst

    # ---- layer by layer, during the forward pass that completes the prompt
    def arm_layers(self, items: list[tuple[str, KVDestination, list[int]]]) -> Callable[[int], None] | None:
        """The per-layer callback of this rank's next step: each layer's runs of these requests go out as soon as
        that layer's attention wrote them. Only requests whose every peer of this rank is connected."""
        todo = []
        for rid, dest, src_blocks in items:
            runs = self.plan(dest)
            peers = [self._connected(dest.ranks[r.dst].agent) for r in runs]
            if not runs or not src_blocks or None in peers or len(src_blocks) != len(dest.block_ids):
                continue
            self._layer_futs[rid] = []
            for run, peer in zip(runs, peers):
                src, dst = self._offsets(run, dest, src_blocks, dest.block_ids)
                heads = np.arange(run.hi - run.lo, dtype=np.int64) * self.head_bytes
                rr = self.agent.peer_region_id(peer, dest.ranks[run.dst].region)
                todo.append((rid, run, peer, (src[:, None] + heads).ravel(), (dst[:, None] + heads).ravel(), rr,
                             dest.request_id))
        if not todo:
            return None
        cuda = self.pool.device.type == "cuda"
        run_bytes = self.pool.run_bytes

        def after_layer(layer: int) -> None:
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            off = layer * run_bytes  # the layer's run under each head of a block
            for rid, run, peer, src_off, dst_off, rr, key in todo:
                xl = XferList.build(self.region_id, src_off + off, rr, dst_off + off, run_bytes)
                fut = self.agent.submit(self.agent.agent.write(peer, xl, None, wait_event=ev, coalesce=False, key=key))
                self._layer_futs[rid].append((run, fut))

        return after_layer

    # ---- the push, after the first token was sampled
    def push(self, request_id: str, dest: KVDestination, src_blocks: list[int], notif: dict) -> None:
        """Send this rank's runs of the request's prompt blocks to their decode ranks, each pair followed by its
        notification; rank 0 reports a `RankPushed` when all of this rank's pairs ended."""
        runs = self.plan(dest)
        layer_futs = self._layer_futs.pop(request_id, None)
        if not runs:
            self.report(RankPushed(self.rank, request_id, None, 0.0, 0, "none"))
            return
        base = {**notif, "src": self.rank, "src_tp": self.tp_size}
        first = {k: notif[k] for k in ("first_token", "logprob") if k in notif}
        # the first token travels once: from prefill rank 0 to decode rank 0
        notifs = [{**{k: v for k, v in base.items() if k not in first},
                   **(first if (self.rank, run.dst) == (0, 0) else {})} for run in runs]
        expected = self.pool.num_layers * len(runs)  # one write per layer and run
        if layer_futs is not None and len(layer_futs) == expected:
            coro = self._finish_layerwise(dest, runs, layer_futs, notifs)
        else:
            if layer_futs:  # partly pushed (the step did not run layer by layer): the blocks go whole as well
                log.debug("rank %d: %s pushed whole (%d of %d layer writes)", self.rank, request_id,
                          len(layer_futs), expected)
            coro = self._push(dest, runs, src_blocks, notifs)
        fut = self.agent.submit(coro)
        self._pushes[request_id] = fut
        fut.add_done_callback(lambda f, rid=request_id: self._on_push_done(rid, f))

    async def _push(self, dest: KVDestination, runs: list[HeadRun], src_blocks: list[int], notifs: list[dict]):
        """Each run of every block (one contiguous run per block), under the decode side's grant, then notify."""
        async def one(run: HeadRun, notif: dict):
            d = dest.ranks[run.dst]
            peer = await self._peer_for(d.agent)
            if not src_blocks:  # everything was a prefix hit on the decode side: only the notification travels
                await self.agent.agent.notify(peer, notif, dest.request_id)
                return None
            src, dst = self._offsets(run, dest, src_blocks, dest.block_ids)
            rr = self.agent.peer_region_id(peer, d.region)
            xl = XferList.build(self.region_id, src, rr, dst, (run.hi - run.lo) * self.head_bytes)
            return await self.agent.agent.write(peer, xl, notif, key=dest.request_id)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r, n) for r, n in zip(runs, notifs)))
        done = [r for r in results if r is not None]
        return (time.perf_counter() - t0, sum(r.nbytes for r in done), done[0].transport if done else "notify")

    async def _finish_layerwise(self, dest: KVDestination, runs: list[HeadRun], futs: list, notifs: list[dict]):
        """Every layer of every run landed: only now do the decode ranks hear of it."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(asyncio.wrap_future(f) for _, f in futs))
        for run, notif in zip(runs, notifs):
            peer = await self._peer_for(dest.ranks[run.dst].agent)
            await self.agent.agent.notify(peer, notif, dest.request_id)
        return (time.perf_counter() - t0, sum(r.nbytes for r in results),
                (results[0].transport if results else "none") + "/layerwise")

    def _on_push_done(self, rid: str, fut: concurrent.futures.Future) -> None:  # agent thread
        self._pushes.pop(rid, None)
        if fut.cancelled():
            self.report(RankPushed(self.rank, rid, "the KV push was cancelled: its lease ran out"))
            return
        e = fut.exception()
        if e is not None:
            self.report(RankPushed(self.rank, rid, f"KV push failed on rank {self.rank}: {type(e).__name__}: {e}"))
            return
        seconds, nbytes, transport = fut.result()
        self.report(RankPushed(self.rank, rid, None, seconds, nbytes, transport))

    def cancel(self, request_id: str) -> None:
        self._layer_futs.pop(request_id, None)
        fut = self._pushes.get(request_id)
        if fut is not None:
            fut.cancel()

    def stats(self) -> dict:
        return {"pushes_in_flight": len(self._pushes)}

    def close(self) -> None:
        try:
            self.agent.close()
        except Exception:  # closing on the way out: nothing left to tell
            log.debug("agent close failed", exc_info=True)


# ---- the notification of one pair, validated at the edge


def parse_notification(n, rank: int, vocab_size: int) -> RankNotified:
    """A notification as a RankNotified; raises ValueError/TypeError/KeyError on anything malformed. The request is
    the one the notification's key names: the agent checked that key against a live grant admitting the sender."""
    rid = n.key
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        raise ValueError("the notification names no request (key)")
    error = getattr(n, "error", None)
    payload = n.payload_dict()
    if error is not None:
        src = payload.get("src") if isinstance(payload, dict) else None
        src_tp = payload.get("src_tp") if isinstance(payload, dict) else None
        ok = _small_int(src, MAX_TP) and _small_int(src_tp, MAX_TP + 1) and src < src_tp
        return RankNotified(rank, rid, src if ok else -1, src_tp if ok else 0, error=str(error)[:1000])
    if payload is None:
        raise TypeError("payload is not a map")
    src, src_tp = payload["src"], payload["src_tp"]
    if not (_small_int(src_tp, MAX_TP + 1) and src_tp >= 1 and _small_int(src, MAX_TP) and src < src_tp):
        raise ValueError(f"src {src!r} of src_tp {src_tp!r} is not a prefill rank")
    t_done = payload["t_prefill_done"]
    if isinstance(t_done, bool) or not isinstance(t_done, (int, float)) or not math.isfinite(t_done):
        raise ValueError("t_prefill_done must be a finite number")
    tok = payload.get("first_token")
    if (src == 0 and rank == 0) != (tok is not None):
        raise ValueError("only the notification from prefill rank 0 to decode rank 0 carries the first token")
    if tok is not None and (isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size):
        raise ValueError(f"first_token {tok!r} is not a token id of this model")
    return RankNotified(rank, rid, src, src_tp, tok, _parse_logprob(payload.get("logprob"), vocab_size),
                        float(t_done))


def _small_int(x: object, bound: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < bound


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


# ---- what rank 0's connector runs on every rank (collective_rpc: fn(worker, ...))


def _kv(worker) -> RankKV:
    return worker.extras["kv"]


def kv_start(worker, config: KVTransferConfig, agent=None) -> dict:
    """Start this rank's agent over its pool; returns where peers reach it and which heads it holds."""
    kv = RankKV(config, rank_pool(worker), worker.rank, worker.tp.size, worker.report, agent)
    worker.extras["kv"] = kv
    return {"rank": worker.rank, "agent": kv.address, "heads": tuple(kv.pool.head_range)}


def kv_grant(worker, request_id: str, block_ids: list[int], deadline: float) -> None:
    _kv(worker).grant(request_id, block_ids, deadline)


def kv_revoke(worker, request_id: str) -> None:
    _kv(worker).revoke(request_id)


def kv_dial(worker, dest: KVDestination) -> None:
    _kv(worker).dial(dest)


def kv_arm_layers(worker, items: list) -> bool:
    """Set this rank's per-layer callback for its next step (Worker.after_layer); whether it has one."""
    worker.after_layer = _kv(worker).arm_layers(items)
    return worker.after_layer is not None


def kv_push(worker, request_id: str, dest: KVDestination, src_blocks: list[int], notif: dict) -> None:
    """Never raises: a push that cannot start is reported as this rank's failed share (the others may be running)."""
    kv = _kv(worker)
    try:
        kv.push(request_id, dest, src_blocks, notif)
    except Exception as e:
        log.exception("rank %d: the push of %s could not start", worker.rank, request_id)
        kv.report(RankPushed(worker.rank, request_id, f"KV push could not start on rank {worker.rank}: "
                                                      f"{type(e).__name__}: {e}"))


def kv_cancel(worker, request_id: str) -> None:
    _kv(worker).cancel(request_id)


def kv_close(worker) -> None:
    kv = worker.extras.pop("kv", None)
    if kv is not None:
        kv.close()

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

The transport is chosen per (prefill rank, decode rank) pair, when this rank's agent dials the decode rank's agent
(`PeerLink`: the agent's choice for that peer, or a clear error when none serves), and named on every write to it,
so every push to one peer takes the same one; each pair's notification says which (the decode side counts it per
peer), and so does the rank's report (`RankPushed.pairs`: per-peer counters on /metrics). Whether a push goes layer
by layer is decided per pair too (`layerwise_for`). Every write and wait of a push is bounded by its lease; a peer
lost since it was dialled is dialled again by the next push to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pdserve.config import KV_LAYERWISE_AUTO_TRANSPORTS, KV_TRANSPORTS, KVTransferConfig
from pdserve.disagg.agent import start_agent, transport_spec
from pdserve.disagg.heads import MAX_TP, HeadRun, head_ranges, push_plan
from pdserve.engine.kv_connector import KVPool
from pdserve.engine.messages import POOL_REGION, KVDestination
from pdserve.kv.descs import XferList
from pdserve.kv.errors import TransportUnavailableError
from pdserve.parallel.ranges import kv_head_range

log = logging.getLogger(__name__)

MAX_REQUEST_ID = 256
MAX_TOP_LOGPROBS = 20
# what a prefill rank may name as the transport that carried a pair of a push ("none": only its notification travelled)
PAIR_TRANSPORTS = frozenset(KV_TRANSPORTS) - {"auto"} | {"none"}


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
    transport: str | None = None  # what carried the pair, as the prefill rank says (PAIR_TRANSPORTS)
    peer: str = ""  # the prefill rank's agent address
    t_push: float | None = None  # when the prefill rank began the push (its clock; the handover's phases)
    t_notified: float | None = None  # when this rank took the notification (this host's clock)


@dataclass(frozen=True)
class RankDropped:
    """Decode side: rank `rank` dropped a malformed notification."""

    rank: int
    peer: str
    why: str


@dataclass(frozen=True)
class PairPushed:
    """Prefill side: one (this rank -> decode rank) pair of a push ended."""

    peer: str  # the decode rank's agent address
    transport: str  # what carried it ("none": only the notification travelled)
    error: str | None = None


@dataclass(frozen=True)
class RankPushed:
    """Prefill side: rank `rank`'s share of a push ended (`error` None: its KV and notifications landed), every pair
    of it (`pairs`) ended."""

    rank: int
    request_id: str
    error: str | None
    seconds: float = 0.0
    nbytes: int = 0
    transport: str | None = None  # the first pair's that moved bytes ("none": only notifications travelled)
    layerwise: bool = False
    pairs: tuple[PairPushed, ...] = ()


@dataclass
class Ahead:
    """Prefill side, one rank: a request's destination blocks [0, covered) written ahead of its last chunk, and
    those writes (run index in the rank's plan, future)."""

    covered: int = 0
    futs: list[tuple[int, concurrent.futures.Future]] = field(default_factory=list)


@dataclass(frozen=True)
class PeerLink:
    """A connected decode rank's agent, as this rank's agent sees it: its name and the transport every push to it
    takes (the agent's choice for that peer when it was dialled)."""

    address: str
    name: str
    transport: str


def layerwise_for(mode: str, transport: str) -> bool:
    """Whether pushes over `transport` go layer by layer (--kv-layerwise `mode`): `on` / `off` as configured; `auto`
    where copies are slow enough to be worth overlapping with the remaining layers' compute
    (KV_LAYERWISE_AUTO_TRANSPORTS: tcp). Every transport can carry them (a layer's runs are ordinary descriptors), so
    `on` is honoured whatever it is."""
    if mode in ("on", "off"):
        return mode == "on"
    return transport in KV_LAYERWISE_AUTO_TRANSPORTS


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
                 report: Callable[[object], None], agent=None, nvtx: bool = False):
        self.config = config
        self.pool = pool
        self.rank = rank
        self.tp_size = tp_size
        self.report = report
        if config.port and agent is None:  # a fixed port: rank r listens on port + r
            config = replace(config, port=config.port + rank)
        self.agent, self.region_id = start_agent(config, pool, agent, nvtx)
        self.spec = transport_spec(config)
        self.head_bytes = pool.num_layers * pool.run_bytes  # one head of one block, every layer, K and V
        self.src_ranges = head_ranges(pool.total_kv_heads, tp_size)
        self._plans: dict[tuple, list[HeadRun]] = {}
        self._connects: dict[str, concurrent.futures.Future] = {}  # decode agent address -> dial (PeerLink)
        self._peers: dict[str, PeerLink] = {}  # decode agent address -> link (replaced whole on the agent thread)
        self._layer_futs: dict[str, list[tuple[HeadRun, concurrent.futures.Future]]] = {}
        self._ahead: dict[str, Ahead] = {}  # request -> its blocks pushed ahead of its last chunk
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
            self.report(parse_notification(n, self.rank, self.pool.vocab_size, self.agent.peer_address(n.peer)))
        except (ValueError, TypeError, KeyError) as e:
            peer = str(getattr(n, "peer", "?"))
            log.warning("rank %d dropped a malformed KV notification from %s: %s", self.rank, peer, e)
            self.report(RankDropped(self.rank, peer, str(e)[:200]))

    # ---- prefill side: connections, one per decode rank's agent, made once and reused
    def _on_peer_lost(self, peer: str, why: str) -> None:  # agent thread
        self._peers = {a: p for a, p in self._peers.items() if p.name != peer}

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
            if f is None or (f.done() and self._connected(address) is None):  # never dialled, failed, or lost since
                self._connects[address] = self.agent.submit(self._peer_for(address))

    async def _peer_for(self, address: str) -> PeerLink:
        """The link to the decode agent at `address`, dialled (and its transport chosen) when there is none."""
        link = self._peers.get(address)
        if link is None:
            name = await self.agent.agent.connect(address)
            link = self._peers.get(address)  # a dial and a push may both have waited for the same connection
            if link is not None and link.name == name:
                return link
            choice = self.agent.agent.peer_transport(name)
            if choice["transport"] == "none":
                why = "; ".join(f"{k}: {v}" for k, v in choice["unavailable"].items()) or "no transport applies"
                raise TransportUnavailableError(f"rank {self.rank}: no KV transport of this instance serves the "
                                                f"decode agent at {address}: {why}")
            link = PeerLink(address, name, choice["transport"])
            self._peers = {**self._peers, address: link}
        return link

    def _connected(self, address: str) -> PeerLink | None:
        """The link to `address` when it is connected now (made by a dial or a push; a lost peer's link is dropped
        by `_on_peer_lost`)."""
        return self._peers.get(address)

    def _transport_to(self, address: str) -> str:
        """The transport of the link to `address`, or this instance's configured one (for counting a pair that
        failed before its link was made)."""
        link = self._peers.get(address)
        return link.transport if link is not None else self.spec.transport

    def _offsets(self, run: HeadRun, dest: KVDestination, src_blocks, dst_blocks) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of the run's first head in each source and destination block."""
        d = dest.ranks[run.dst]
        src = np.asarray(src_blocks, dtype=np.int64) * self.pool.block_bytes + \
            (run.lo - self.pool.head_range[0]) * self.head_bytes
        dst = np.asarray(dst_blocks, dtype=np.int64) * (d.num_heads * self.head_bytes) + \
            (run.lo - d.head_start) * self.head_bytes
        return src, dst

    # ---- layer by layer, during the forward pass that completes the prompt
    def arm_layers(self, items: list[tuple[str, KVDestination, list[int]]], mode: str) -> Callable[[int], None] | None:
        """The per-layer callback of this rank's next step: each layer's runs of these requests go out as soon as
        that layer's attention wrote them. Only requests whose every peer of this rank is connected over a transport
        that goes layer by layer (`layerwise_for(mode, ...)`); the others are pushed whole after the prefill."""
        todo = []
        for rid, dest, src_blocks in items:
            runs = self.plan(dest)
            links = [self._connected(dest.ranks[r.dst].agent) for r in runs]
            if not runs or not src_blocks or None in links or len(src_blocks) != len(dest.block_ids):
                continue
            if not all(layerwise_for(mode, link.transport) for link in links):
                continue
            self._layer_futs[rid] = []
            for run, link in zip(runs, links):
                src, dst = self._offsets(run, dest, src_blocks, dest.block_ids)
                heads = np.arange(run.hi - run.lo, dtype=np.int64) * self.head_bytes
                rr = self.agent.peer_region_id(link.name, dest.ranks[run.dst].region)
                todo.append((rid, run, link, (src[:, None] + heads).ravel(), (dst[:, None] + heads).ravel(), rr,
                             dest.request_id))
        if not todo:
            return None
        cuda = self.pool.device.type == "cuda"
        run_bytes = self.pool.run_bytes
        timeout = self.config.lease_s  # a layer's write may take no longer than a whole push's lease

        def after_layer(layer: int) -> None:
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            off = layer * run_bytes  # the layer's run under each head of a block
            for rid, run, link, src_off, dst_off, rr, key in todo:
                xl = XferList.build(self.region_id, src_off + off, rr, dst_off + off, run_bytes)
                fut = self.agent.submit(self.agent.agent.write(link.name, xl, None, wait_event=ev, coalesce=False,
                                                               key=key, transport=link.transport, timeout=timeout))
                self._layer_futs[rid].append((run, fut))

        return after_layer

    # ---- ahead of the push: chunks before a prompt's last
    def push_ahead(self, items: list[tuple[str, KVDestination, list[int]]], mode: str) -> None:
        """Write each request's destination blocks that this rank has not yet pushed, up to `len(src_blocks)`
        (computed by the step just queued on this device: the writes wait for it), with no notification: the push
        after the prefill sends the rest and then notifies. Only where every peer of this rank's runs is connected
        over a transport that does not go layer by layer (those pairs take everything during the last chunk)."""
        ev = None
        for rid, dest, src_blocks in items:
            ahead = self._ahead.get(rid, Ahead())
            lo, hi = ahead.covered, len(src_blocks)
            runs = self.plan(dest)
            links = [self._connected(dest.ranks[r.dst].agent) for r in runs]
            if hi <= lo or not runs or None in links or any(layerwise_for(mode, k.transport) for k in links):
                continue
            if ev is None and self.pool.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
            self._ahead[rid] = ahead  # before any write starts: every write of it is waited for
            for i, (run, link) in enumerate(zip(runs, links)):
                src, dst = self._offsets(run, dest, src_blocks[lo:hi], dest.block_ids[lo:hi])
                rr = self.agent.peer_region_id(link.name, dest.ranks[run.dst].region)
                xl = XferList.build(self.region_id, src, rr, dst, (run.hi - run.lo) * self.head_bytes)
                ahead.futs.append((i, self.agent.submit(self.agent.agent.write(
                    link.name, xl, None, wait_event=ev, key=dest.request_id, timeout=self.config.lease_s,
                    transport=link.transport))))
            ahead.covered = hi

    def abandon(self, request_id: str) -> None:
        """The request's export ended before its push: report this rank's end once its writes pushed ahead ended
        (at once when it has none)."""
        ahead = self._ahead.pop(request_id, None)
        why = "the request ended before its KV push (aborted or preempted)"
        if ahead is None or not ahead.futs:
            self.report(RankPushed(self.rank, request_id, why))
            return
        fut = self.agent.submit(_ended(ahead.futs, self.config.lease_s))
        self._pushes[request_id] = fut

        def done(f: concurrent.futures.Future) -> None:  # agent thread
            self._pushes.pop(request_id, None)
            self.report(RankPushed(self.rank, request_id, why))

        fut.add_done_callback(done)

    # ---- the push, after the first token was sampled
    def push(self, request_id: str, dest: KVDestination, src_blocks: list[int], notif: dict,
             deadline: float | None = None) -> None:
        """Send this rank's runs of the request's prompt blocks to their decode ranks, each pair followed by its
        notification (naming the pair's transport), all within what is left of the push's lease (`deadline`);
        rank 0 reports a `RankPushed` when all of this rank's pairs ended."""
        runs = self.plan(dest)
        layer_futs = self._layer_futs.pop(request_id, None)
        ahead = self._ahead.pop(request_id, None)
        if not runs:
            self.report(RankPushed(self.rank, request_id, None, 0.0, 0, "none"))
            return
        timeout = max(0.001, deadline - time.time()) if deadline is not None else self.config.lease_s
        base = {**notif, "src": self.rank, "src_tp": self.tp_size, "t_push": time.time()}
        first = {k: notif[k] for k in ("first_token", "logprob") if k in notif}
        # the first token travels once: from prefill rank 0 to decode rank 0
        notifs = [{**{k: v for k, v in base.items() if k not in first},
                   **(first if (self.rank, run.dst) == (0, 0) else {})} for run in runs]
        expected = self.pool.num_layers * len(runs)  # one write per layer and run
        if layer_futs is not None and len(layer_futs) == expected and ahead is None:
            coro = self._finish_layerwise(request_id, dest, runs, layer_futs, notifs, timeout)
        else:
            if layer_futs:  # partly pushed (the step did not run layer by layer): the blocks go whole as well
                log.debug("rank %d: %s pushed whole (%d of %d layer writes)", self.rank, request_id,
                          len(layer_futs), expected)
            coro = self._push(request_id, dest, runs, src_blocks, notifs, timeout, ahead)
        fut = self.agent.submit(coro)
        self._pushes[request_id] = fut
        peers = [dest.ranks[run.dst].agent for run in runs]
        fut.add_done_callback(lambda f, rid=request_id, peers=peers: self._on_push_done(rid, peers, f))

    async def _push(self, request_id: str, dest: KVDestination, runs: list[HeadRun], src_blocks: list[int],
                    notifs: list[dict], timeout: float, ahead: Ahead | None = None) -> RankPushed:
        """Each run of every block (one contiguous run per block) not pushed ahead, under the decode side's grant,
        over the pair's transport, then notify, once the pair's writes pushed ahead landed too. Every pair ends
        (each write bounded by `timeout`) before the rank's share does."""
        t0 = time.perf_counter()
        covered, failed, ahead_bytes = 0, {}, 0
        if ahead is not None:
            covered = ahead.covered
            results = await _ended(ahead.futs, timeout)
            for (i, _), r in zip(ahead.futs, results):
                if isinstance(r, BaseException):
                    failed.setdefault(i, f"{type(r).__name__}: {r}")
                else:
                    ahead_bytes += r.nbytes
        rest_src, rest_dst = src_blocks[covered:], dest.block_ids[covered:]

        async def one(i: int, run: HeadRun, notif: dict) -> tuple[PairPushed, int]:
            d = dest.ranks[run.dst]
            transport = self._transport_to(d.agent)
            if i in failed:  # a write pushed ahead failed: the pair failed
                return PairPushed(d.agent, transport, failed[i]), 0
            try:
                link = await self._peer_for(d.agent)
                transport = link.transport
                if not rest_src:  # a prefix hit on the decode side, or all pushed ahead: only the notification
                    moved = transport if covered else "none"
                    await self.agent.agent.notify(link.name, {**notif, "transport": moved}, dest.request_id)
                    return PairPushed(d.agent, moved), 0
                src, dst = self._offsets(run, dest, rest_src, rest_dst)
                rr = self.agent.peer_region_id(link.name, d.region)
                xl = XferList.build(self.region_id, src, rr, dst, (run.hi - run.lo) * self.head_bytes)
                r = await self.agent.agent.write(link.name, xl, {**notif, "transport": transport},
                                                 key=dest.request_id, timeout=timeout, transport=transport)
                return PairPushed(d.agent, r.transport), r.nbytes
            except Exception as e:  # a KVTransferError, or a bug: the pair's end is reported, never lost
                return PairPushed(d.agent, transport, f"{type(e).__name__}: {e}"), 0

        ends = await asyncio.gather(*(one(i, r, n) for i, (r, n) in enumerate(zip(runs, notifs))))
        return self._pushed(request_id, [p for p, _ in ends], time.perf_counter() - t0,
                            ahead_bytes + sum(n for _, n in ends), False)

    async def _finish_layerwise(self, request_id: str, dest: KVDestination, runs: list[HeadRun], futs: list,
                                notifs: list[dict], timeout: float) -> RankPushed:
        """Every layer of every run landed (within `timeout`): only now do the decode ranks hear of it."""
        t0 = time.perf_counter()
        peers = [dest.ranks[run.dst].agent for run in runs]
        results = await _ended(futs, timeout)
        failed: dict[int, str] = {}  # run index -> its first failed layer write
        for (run, _), r in zip(futs, results):
            if isinstance(r, BaseException):
                failed.setdefault(runs.index(run), f"{type(r).__name__}: {r}")
        pairs = []
        for i, (address, notif) in enumerate(zip(peers, notifs)):
            transport = self._transport_to(address)
            if i in failed:
                pairs.append(PairPushed(address, transport, failed[i]))
                continue
            try:
                link = await self._peer_for(address)
                await self.agent.agent.notify(link.name, {**notif, "transport": link.transport}, dest.request_id)
                pairs.append(PairPushed(address, link.transport))
            except Exception as e:
                pairs.append(PairPushed(address, transport, f"{type(e).__name__}: {e}"))
        nbytes = sum(r.nbytes for r in results if not isinstance(r, BaseException))
        return self._pushed(request_id, pairs, time.perf_counter() - t0, nbytes, True)

    def _pushed(self, request_id: str, pairs: list[PairPushed], seconds: float, nbytes: int,
                layerwise: bool) -> RankPushed:
        errors = [p.error for p in pairs if p.error is not None]
        transport = next((p.transport for p in pairs if p.transport != "none"), "none")
        return RankPushed(self.rank, request_id, f"KV push failed on rank {self.rank}: {errors[0]}" if errors else None,
                          seconds, nbytes, transport, layerwise, tuple(pairs))

    def _on_push_done(self, rid: str, peers: list[str], fut: concurrent.futures.Future) -> None:  # agent thread
        self._pushes.pop(rid, None)
        if fut.cancelled():
            why = "the KV push was cancelled: its lease ran out"
        elif fut.exception() is not None:
            e = fut.exception()
            why = f"KV push failed on rank {self.rank}: {type(e).__name__}: {e}"
        else:
            self.report(fut.result())
            return
        pairs = tuple(PairPushed(p, self._transport_to(p), why) for p in peers)
        self.report(RankPushed(self.rank, rid, why, transport=pairs[0].transport if pairs else None, pairs=pairs))

    def cancel(self, request_id: str) -> None:
        self._layer_futs.pop(request_id, None)
        self._ahead.pop(request_id, None)
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


async def _ended(futs: list[tuple[object, concurrent.futures.Future]], timeout: float) -> list:
    """Each (key, write) pair's result or exception once every write ended, landed or failed (at most `timeout`)."""
    return await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for _, f in futs), return_exceptions=True),
                                  timeout)


# ---- the notification of one pair, validated at the edge


def parse_notification(n, rank: int, vocab_size: int, peer: str = "") -> RankNotified:
    """A notification as a RankNotified; raises ValueError/TypeError/KeyError on anything malformed. The request is
    the one the notification's key names: the agent checked that key against a live grant admitting the sender.
    `peer`: the sender's address (for the per-peer counters)."""
    rid = n.key
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        raise ValueError("the notification names no request (key)")
    error = getattr(n, "error", None)
    payload = n.payload_dict()
    if error is not None:
        src = payload.get("src") if isinstance(payload, dict) else None
        src_tp = payload.get("src_tp") if isinstance(payload, dict) else None
        ok = _small_int(src, MAX_TP) and _small_int(src_tp, MAX_TP + 1) and src < src_tp
        try:  # a failure is taken whatever its payload says: the request must not wait out its lease
            transport = _parse_transport(payload)
        except ValueError:
            transport = None
        return RankNotified(rank, rid, src if ok else -1, src_tp if ok else 0, error=str(error)[:1000],
                            transport=transport, peer=peer)
    if payload is None:
        raise TypeError("payload is not a map")
    transport = _parse_transport(payload)
    src, src_tp = payload["src"], payload["src_tp"]
    if not (_small_int(src_tp, MAX_TP + 1) and src_tp >= 1 and _small_int(src, MAX_TP) and src < src_tp):
        raise ValueError(f"src {src!r} of src_tp {src_tp!r} is not a prefill rank")
    t_done = payload["t_prefill_done"]
    if not _finite(t_done):
        raise ValueError("t_prefill_done must be a finite number")
    t_push = payload.get("t_push")  # optional (for the handover's phases); a peer that sends none is still served
    if t_push is not None and not _finite(t_push):
        raise ValueError("t_push must be a finite number")
    tok = payload.get("first_token")
    if (src == 0 and rank == 0) != (tok is not None):
        raise ValueError("only the notification from prefill rank 0 to decode rank 0 carries the first token")
    if tok is not None and (isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size):
        raise ValueError(f"first_token {tok!r} is not a token id of this model")
    return RankNotified(rank, rid, src, src_tp, tok, _parse_logprob(payload.get("logprob"), vocab_size),
                        float(t_done), None, transport, peer, None if t_push is None else float(t_push), time.time())


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse_transport(payload: object) -> str | None:
    """The transport a pair's notification names (None when it names none)."""
    t = payload.get("transport") if isinstance(payload, dict) else None
    if t is None:
        return None
    if not isinstance(t, str) or t not in PAIR_TRANSPORTS:
        raise ValueError(f"transport {str(t)[:32]!r} is not one of {sorted(PAIR_TRANSPORTS)}")
    return t


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
    kv = RankKV(config, rank_pool(worker), worker.rank, worker.tp.size, worker.report, agent,
                nvtx=bool(getattr(worker.config, "nvtx", False)))
    worker.extras["kv"] = kv
    return {"rank": worker.rank, "agent": kv.address, "heads": tuple(kv.pool.head_range)}


def kv_grant(worker, request_id: str, block_ids: list[int], deadline: float) -> None:
    _kv(worker).grant(request_id, block_ids, deadline)


def kv_revoke(worker, request_id: str) -> None:
    _kv(worker).revoke(request_id)


def kv_dial(worker, dest: KVDestination) -> None:
    _kv(worker).dial(dest)


def kv_arm_layers(worker, items: list, mode: str) -> bool:
    """Set this rank's per-layer callback for its next step (Worker.after_layer); whether it has one. `mode`:
    --kv-layerwise (auto: per peer, by its transport)."""
    worker.after_layer = _kv(worker).arm_layers(items, mode)
    return worker.after_layer is not None


def kv_push(worker, request_id: str, dest: KVDestination, src_blocks: list[int], notif: dict,
            deadline: float | None = None) -> None:
    """Never raises: a push that cannot start is reported as this rank's failed share (the others may be running).
    `deadline`: the push's lease (time.time()); every write of it ends by then."""
    kv = _kv(worker)
    try:
        kv.push(request_id, dest, src_blocks, notif, deadline)
    except Exception as e:
        log.exception("rank %d: the push of %s could not start", worker.rank, request_id)
        kv.report(RankPushed(worker.rank, request_id, f"KV push could not start on rank {worker.rank}: "
                                                      f"{type(e).__name__}: {e}"))


def kv_push_ahead(worker, items: list, mode: str) -> None:
    """Never raises: a write that cannot start here leaves its blocks to the push after the prefill."""
    try:
        _kv(worker).push_ahead(items, mode)
    except Exception:
        log.exception("rank %d: pushing ahead failed; the push after the prefill sends those blocks", worker.rank)


def kv_abandon(worker, request_id: str) -> None:
    _kv(worker).abandon(request_id)


def kv_cancel(worker, request_id: str) -> None:
    _kv(worker).cancel(request_id)


def kv_close(worker) -> None:
    kv = worker.extras.pop("kv", None)
    if kv is not None:
        kv.close()

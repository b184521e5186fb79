"""The engine-side half of the KV handover, one object per engine process.

Decode side: a request that arrives with prefill candidates gets its blocks reserved at once (prefix-cache hits
included, so only the missing blocks travel); the server process then asks a prefill instance to compute the
prompt and push the KV straight into those blocks; the agent's notification (sent only after the bytes landed)
admits the request into the running batch with the first token. No temporary buffers, no polling.

Prefill side: a request with an export destination is prefilled as usual; when its first token is sampled its
blocks are held (not freed) while the transfer engine pushes them, then released.

Every held or reserved block has an owner and a deadline: blocks a remote peer might still write into are kept
in quarantine until that peer confirms it is done, is gone, or the lease expires. A decode instance never
decodes on KV whose transfer did not complete.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from pdserve.engine.engine_core import CoreOutput, EngineCore
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv.descs import XferList
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class HeldExport:
    """Prefill side: blocks held while their KV is pushed to a decode instance."""

    req: Request
    future: object
    first_output: CoreOutput
    t_prefill_done: float
    deadline: float
    aborted: bool = False


@dataclass
class Reservation:
    """Decode side: a request whose prompt KV is in flight from a prefill instance."""

    req: Request
    t_arrival: float
    t_reserved: float = 0.0
    start_block: int = 0
    attempt: int = 0
    deadline: float = 0.0


@dataclass
class Quarantine:
    block_ids: list[int]
    deadline: float
    request_id: str


@dataclass
class ConnectorStats:
    exports: int = 0
    layerwise_exports: int = 0
    export_failures: int = 0
    imports: int = 0
    fallbacks: int = 0
    quarantined_blocks: int = 0
    handover_s: list[float] = field(default_factory=list)


class PDConnector:
    def __init__(self, core: EngineCore, role: str, agent, wake, lease_s: float = 30.0, recompute: bool = True,
                 layerwise: bool = False):
        self.role = role
        self.agent = agent
        self.wake = wake
        self.lease_s = lease_s
        self.recompute = recompute  # a failed handover: recompute the prefill here (True) or fail the request
        # push each layer's KV as soon as it is computed (pays where the copy is slow, e.g. tcp): the transfer
        # of layer l overlaps the compute of layers l+1..L and only the last layer's bytes remain after prefill
        self.layerwise = layerwise
        shape = core.runner.kv_cache.shape  # [blocks, layers, 2, block_size, heads, dim]
        self.num_layers = shape[1]
        self.layer_bytes = core.block_bytes // self.num_layers
        self._connects: dict[str, object] = {}  # agent address -> future of the connection (peer name)
        self.layer_futs: dict[str, list] = {}
        self.region_id = agent.register(core.runner.kv_cache, name="kv")
        self.block_bytes = core.block_bytes
        self.block_size = core.config.block_size
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # from the agent thread
        self._peers: dict[str, str] = {}  # agent address -> connected peer name
        self.exports: dict[str, HeldExport] = {}
        self.reservations: dict[str, Reservation] = {}
        self.pending_reserve: deque[Reservation] = deque()
        self.ready: deque[tuple[Request, list[int], dict]] = deque()
        self.quarantine: dict[str, Quarantine] = {}
        self.stats = ConnectorStats()
        agent.on_notification(self._on_notification)
        agent.on_peer_lost(lambda peer, why: self._events.put(("peer_lost", peer, why)))

    def describe(self) -> dict:
        return {"agent": self.agent.address, "region": "kv", "block_bytes": self.block_bytes,
                "block_size": self.block_size, "role": self.role}

    # ---- agent thread -> engine loop
    def _on_notification(self, n) -> None:
        self._events.put(("notif", n))
        self.wake()

    def _on_export_done(self, rid: str, fut) -> None:
        self._events.put(("export_done", rid, fut))
        self.wake()

    def has_events(self) -> bool:
        return (not self._events.empty()) or bool(self.pending_reserve) or bool(self.ready) or (
            bool(self.quarantine) or bool(self.exports) or bool(self.reservations))

    # ---- requests arriving with `pd`
    def add_request(self, core: EngineCore, rid: str, ids: list[int], params: SamplingParams, pd: dict) -> None:
        if "export" in pd:
            req = core.make_request(rid, ids, params)
            req.kv_export = pd["export"]
            self._connect_early(pd["export"]["agent"])
            core.requests[rid] = req
            core.scheduler.add(req)
            return
        if pd.get("prefill_urls"):
            req = core.make_request(rid, ids, params)
            req.kv_import = {"prefill_urls": pd["prefill_urls"]}
            core.requests[rid] = req
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            core.scheduler.remote[rid] = req
            self.pending_reserve.append(Reservation(req, time.time()))
            return
        core.add_request(rid, ids, params)

    def _try_reserve(self, core: EngineCore, res: Reservation) -> CoreOutput | None:
        req = res.req
        kv = core.kv
        prefix_blocks, num_cached = kv.find_cached_prefix(req)
        if not kv.allocate(req, req.num_prompt_tokens - num_cached, prefix_blocks):
            return None
        req.num_cached_tokens = num_cached
        res.start_block = num_cached // self.block_size
        res.t_reserved = time.time()
        res.deadline = res.t_reserved + self.lease_s
        self.reservations[req.request_id] = res
        nb = (req.num_prompt_tokens + self.block_size - 1) // self.block_size
        event = {
            "pd_event": "reserved",
            "agent": self.agent.address,
            "region": "kv",
            "block_ids": req.block_ids[res.start_block:nb],
            "start_block": res.start_block,
            "num_cached_tokens": num_cached,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
        }
        return CoreOutput(req.request_id, [], False, num_prompt_tokens=req.num_prompt_tokens,
                          num_cached_tokens=num_cached, extra=event)

    # ---- prefill side: after the first token of an export request was sampled
    def after_prefill(self, core: EngineCore, req: Request, out: CoreOutput) -> None:
        dest = req.kv_export
        core.scheduler.running.remove(req)
        req.status = RequestStatus.FINISHED  # out of the scheduler; the blocks stay with us until the push ends
        t_done = time.time()
        nb = (req.num_prompt_tokens + self.block_size - 1) // self.block_size
        start = int(dest.get("start_block", 0))
        src = req.block_ids[start:nb]
        dst = list(dest["block_ids"])
        if len(src) != len(dst):
            out.finished, out.finish_reason = True, "error"
            out.stop_reason = f"destination has {len(dst)} blocks for {len(src)} blocks of KV"
            core.requests.pop(req.request_id, None)
            core.kv.free(req)
            return
        lp = out.logprobs[0] if out.logprobs else None
        notif = {"request_id": dest["request_id"], "first_token": out.new_token_ids[0],
                 "logprob": list(lp) if lp else None, "t_prefill_done": t_done,
                 "num_blocks": len(dst)}
        layer_futs = self.layer_futs.pop(req.request_id, None)
        if layer_futs is not None and len(layer_futs) == self.num_layers:
            fut = self.agent.submit(self._finish_layerwise(dest["agent"], layer_futs, notif))
            self.stats.layerwise_exports += 1
        else:
            fut = self.agent.submit(self._push(dest["agent"], src, dst, dest.get("region", "kv"), notif))
        fut.add_done_callback(lambda f, rid=req.request_id: self._on_export_done(rid, f))
        self.exports[req.request_id] = HeldExport(req, fut, out, t_done, t_done + self.lease_s)
        out.finished = False  # the request ends when the push does
        out.finish_reason = None
        self.stats.exports += 1

    def _connect_early(self, address: str) -> None:
        """Dial the decode peer while the prompt is still being computed (once per peer; reused after)."""
        f = self._connects.get(address)
        if f is None or (f.done() and f.exception() is not None):
            self._connects[address] = self.agent.submit(self._peer_for(address))

    async def _peer_for(self, address: str) -> str:
        peer = self._peers.get(address)
        if peer is None:
            peer = await self.agent.agent.connect(address)
            self._peers[address] = peer
        return peer

    def layer_hook(self, core: EngineCore, batch):
        """A per-layer callback for this step when it completes the prefill of export requests whose peer is
        connected, or None. Each call pushes that layer's slice of every such request's blocks."""
        if not self.layerwise:
            return None
        todo = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            dest = req.kv_export
            if dest is None or req.num_computed_tokens + n != req.num_tokens:
                continue
            f = self._connects.get(dest["agent"])
            if f is None or not f.done() or f.exception() is not None:
                continue  # not connected yet: this request is pushed whole after its prefill
            peer = f.result()
            nb = (req.num_prompt_tokens + self.block_size - 1) // self.block_size
            start = int(dest.get("start_block", 0))
            src = np.asarray(req.block_ids[start:nb], dtype=np.int64)
            dst = np.asarray(dest["block_ids"], dtype=np.int64)
            if src.size == 0 or src.size != dst.size:
                continue
            rr = self.agent.agent.peer(peer).region_id(dest.get("region", "kv"))
            self.layer_futs[req.request_id] = []
            todo.append((req.request_id, peer, src * self.block_bytes, dst * self.block_bytes, rr))
        if not todo:
            return None
        cuda = core.device.type == "cuda"

        def after_layer(layer: int) -> None:
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            off = layer * self.layer_bytes
            for rid, peer, src_off, dst_off, rr in todo:
                xl = XferList.build(self.region_id, src_off + off, rr, dst_off + off, self.layer_bytes)
                self.layer_futs[rid].append(self.agent.submit(
                    self.agent.agent.write(peer, xl, None, wait_event=ev, coalesce=False)))

        return after_layer

    async def _finish_layerwise(self, address: str, futs: list, notif: dict) -> dict:
        """Every layer landed: only now does the decode side hear of it (with the first token)."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        peer = await self._peer_for(address)
        await self.agent.agent.notify(peer, notif)
        return {"seconds": time.perf_counter() - t0, "nbytes": sum(r.nbytes for r in results),
                "transport": (results[0].transport if results else "none") + "/layerwise"}

    async def _push(self, address: str, src: list[int], dst: list[int], region: str, notif: dict):
        peer = self._peers.get(address)
        if peer is None:
            peer = await self.agent.agent.connect(address)
            self._peers[address] = peer
        if not src:  # everything was a prefix hit on the decode side: only the notification travels
            await self.agent.agent.notify(peer, notif)
            return None
        return await self.agent.agent.write_blocks(peer, src, dst, self.block_bytes, self.region_id, region, notif)

    # ---- the engine loop calls this before scheduling
    def before_step(self, core: EngineCore) -> list[CoreOutput]:
        outs: list[CoreOutput] = []
        now = time.time()
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                break
            kind = ev[0]
            if kind == "notif":
                outs.extend(self._on_kv_arrived(core, ev[1]))
            elif kind == "export_done":
                outs.extend(self._finish_export(core, ev[1], ev[2]))
            elif kind == "emit":
                outs.append(ev[1])
            elif kind == "peer_lost":
                self._peers = {a: p for a, p in self._peers.items() if p != ev[1]}
        # reservations wait for free blocks, in arrival order
        while self.pending_reserve:
            o = self._try_reserve(core, self.pending_reserve[0])
            if o is None:
                break
            self.pending_reserve.popleft()
            outs.append(o)
        # admitted requests join the batch as room allows
        sched = core.scheduler
        while self.ready and len(sched.running) < sched.max_num_seqs:
            req, _, _ = self.ready.popleft()
            req.status = RequestStatus.RUNNING
            sched.running.append(req)
        # leases
        for rid, q in list(self.quarantine.items()):
            if now > q.deadline:
                core.kv.pool.release(q.block_ids)
                del self.quarantine[rid]
        for rid, res in list(self.reservations.items()):
            if now > res.deadline:
                outs.extend(self._fail_reservation(core, rid, "the KV handover did not complete within its lease",
                                                   self.recompute))
        for ex in list(self.exports.values()):
            if now > ex.deadline and not ex.future.done():
                ex.future.cancel()
        return outs

    def _finish_export(self, core: EngineCore, rid: str, fut) -> list[CoreOutput]:
        ex = self.exports.pop(rid, None)
        if ex is None:
            return []
        core.kv.free(ex.req)  # the push ended one way or the other: nothing writes from these blocks any more
        core.requests.pop(rid, None)
        try:
            res = fut.result()
            err = None
        except BaseException as e:  # noqa: BLE001 - any failure ends this export with its reason
            res, err = None, f"KV push failed: {type(e).__name__}: {e}"
            self.stats.export_failures += 1
        if ex.aborted:
            return []
        if isinstance(res, dict):  # layer-by-layer push
            res = SimpleNamespace(**res)
        timings = {"t_prefill_done": ex.t_prefill_done, "t_push_done": time.time(),
                   "push_s": res.seconds if res is not None else None,
                   "bytes": res.nbytes if res is not None else 0,
                   "transport": res.transport if res is not None else None,
                   "first_scheduled_time": ex.req.first_scheduled_time}
        return [CoreOutput(rid, [], True, "error" if err else "length", err, None, ex.req.num_prompt_tokens,
                           max(ex.req.num_cached_tokens, 0), ex.req.first_scheduled_time,
                           extra={"pd_event": "pushed", **timings})]

    def _on_kv_arrived(self, core: EngineCore, n) -> list[CoreOutput]:
        payload = n.unpack()
        rid = payload.get("request_id")
        q = self.quarantine.pop(rid, None)
        if q is not None:  # the push we gave up on did finish: its blocks are safe to reuse now
            core.kv.pool.release(q.block_ids)
        if getattr(n, "error", None) is not None:  # the sender reports the push failed: never decode on it
            return self._fail_reservation(core, rid, f"the KV push failed: {n.error}", self.recompute, True)
        res = self.reservations.pop(rid, None)
        if res is None:
            return []
        req = res.req
        core.scheduler.remote.pop(rid, None)
        t_admit = time.time()
        req.num_computed_tokens = req.num_prompt_tokens
        core.kv.cache_computed(req)  # the received full blocks serve later prefix hits too
        tok = int(payload["first_token"])
        req.append_token(tok)
        req.first_token_time = t_admit
        if req.generator is not None and not req.params.greedy:
            # keep seeded sampling identical to a colocated run: the prefill peer drew the first sample
            torch.empty(core.hf_config.vocab_size, device=core.device).exponential_(generator=req.generator)
        handover = t_admit - float(payload.get("t_prefill_done", t_admit))
        self.stats.imports += 1
        self.stats.handover_s.append(handover)
        timings = {"pd_event": "admitted", "queue_s": res.t_reserved - res.t_arrival,
                   "t_reserved": res.t_reserved, "t_prefill_done": payload.get("t_prefill_done"),
                   "t_admitted": t_admit, "handover_s": handover}
        lp = payload.get("logprob")
        done = req.check_stop(core.max_model_len)
        out = CoreOutput(rid, [tok], done, req.finish_reason if done else None, req.stop_reason if done else None,
                         [tuple(lp)] if (lp and req.params.logprobs is not None) else None,
                         req.num_prompt_tokens, max(req.num_cached_tokens, 0), res.t_reserved, extra=timings)
        if done:
            core.requests.pop(rid, None)
            core.kv.free(req)
            req.status = RequestStatus.FINISHED
        else:
            self.ready.append((req, [], timings))
        return [out]

    def _fail_reservation(self, core: EngineCore, rid: str, why: str, local_fallback: bool = True,
                          peer_done: bool = False) -> list[CoreOutput]:
        """The remote prefill failed or timed out: recompute locally (or fail), never decode on missing KV."""
        res = self.reservations.pop(rid, None)
        if res is None:
            return []
        req = res.req
        core.scheduler.remote.pop(rid, None)
        if peer_done:
            core.kv.free(req)
        else:  # the peer may still be writing: keep its blocks out of circulation until the lease ends
            self.quarantine[rid] = Quarantine(req.block_ids, time.time() + self.lease_s, rid)
            self.stats.quarantined_blocks += len(req.block_ids)
            req.block_ids = []
            req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.kv_import = None
        if local_fallback:
            self.stats.fallbacks += 1
            req.status = RequestStatus.WAITING
            req.num_cached_tokens = -1
            core.scheduler.waiting.appendleft(req)
            return [CoreOutput(rid, [], False, extra={"pd_event": "fallback_local", "reason": why})]
        core.requests.pop(rid, None)
        req.status = RequestStatus.FINISHED
        return [CoreOutput(rid, [], True, "error", why)]

    # ---- calls from the server process (AsyncLLM.call)
    def prefill_failed(self, core: EngineCore, rid: str, why: str, local_fallback: bool, peer_done: bool) -> bool:
        outs = self._fail_reservation(core, rid, why, local_fallback and self.recompute, peer_done)
        for o in outs:
            self._events.put(("emit", o))
        self.wake()
        return bool(outs)

    def release(self, core: EngineCore, rid: str) -> bool:
        """The prefill peer confirmed it will not write for `rid` any more."""
        q = self.quarantine.pop(rid, None)
        if q is not None:
            core.kv.pool.release(q.block_ids)
            return True
        return False

    def connector_stats(self, core: EngineCore) -> dict:
        h = sorted(self.stats.handover_s[-1000:])
        return {"exports": self.stats.exports, "layerwise_exports": self.stats.layerwise_exports,
                "export_failures": self.stats.export_failures,
                "imports": self.stats.imports, "fallbacks": self.stats.fallbacks,
                "quarantine_blocks": sum(len(q.block_ids) for q in self.quarantine.values()),
                "handover_p50_s": h[len(h) // 2] if h else None}

    def on_abort(self, core: EngineCore, req: Request) -> bool:
        """Returns True when the connector keeps ownership of the request's blocks."""
        rid = req.request_id
        if rid in self.exports:
            self.exports[rid].aborted = True  # blocks are freed when the push ends (it may be mid-copy)
            return True
        if rid in self.reservations:
            res = self.reservations.pop(rid)
            core.scheduler.remote.pop(rid, None)
            self.quarantine[rid] = Quarantine(list(req.block_ids), time.time() + self.lease_s, rid)
            req.block_ids = []
            req.num_registered_blocks = 0
            req.status = RequestStatus.FINISHED
            del res
            return True
        for i, r in enumerate(self.pending_reserve):
            if r.req is req:
                del self.pending_reserve[i]
                core.scheduler.remote.pop(rid, None)
                req.status = RequestStatus.FINISHED
                return True
        for i, (r, _, _) in enumerate(self.ready):
            if r is req:
                del self.ready[i]
                core.kv.free(req)
                req.status = RequestStatus.FINISHED
                return True
        return False

    def close(self) -> None:
        try:
            self.agent.close()
        except Exception:  # closing on the way out: nothing left to tell
            log.debug("agent close failed", exc_info=True)


def attach_connector(core: EngineCore, role_options: dict, wake) -> PDConnector:
    from pdserve.kv import AgentConfig, ThreadedAgent

    kv_opts = dict(role_options.get("kv") or {})
    agent = ThreadedAgent(AgentConfig(**kv_opts))
    conn = PDConnector(core, role_options.get("role", "both"), agent, wake,
                       lease_s=float(role_options.get("lease_s", 30.0)),
                       recompute=role_options.get("fallback", "recompute") == "recompute",
                       layerwise=_layerwise(role_options, core))
    core.connector = conn
    return conn


def _layerwise(role_options: dict, core: EngineCore) -> bool:
    """`auto`: push layer by layer where copies are slow enough to be worth overlapping with compute (tcp)."""
    mode = role_options.get("layerwise", "auto")
    if mode in ("on", "off"):
        return mode == "on"
    transport = (role_options.get("kv") or {}).get("transport", "auto")
    return transport == "tcp" or (transport == "auto" and core.device.type == "cpu")

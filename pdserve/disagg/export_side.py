"""The prefill (export) side of the KV handover: push a computed prompt's KV into the blocks a decode instance
reserved, then notify it with the first token.

The engine asks and hands work; this side only moves bytes: `on_added` dials the decode peer while the prompt
computes, `layer_hook` (over slow transports) sends each layer's slice as soon as that layer's attention wrote it,
`start_export` pushes the rest (coalesced block runs) and notifies, `take_finished_exports` reports each push's end
(the scheduler then frees the blocks), `cancel_export` stops a push whose lease ran out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import torch

from pdserve.config import KVTransferConfig
from pdserve.disagg.agent import POOL_REGION, start_agent
from pdserve.engine.kv_connector import ExportResult, KVConnector, KVPool
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ExportStart, ScheduledBatch
from pdserve.kv.descs import XferList

log = logging.getLogger(__name__)


def num_prompt_blocks(req: Request, block_size: int) -> int:
    return (req.num_prompt_tokens + block_size - 1) // block_size


class PrefillExporter(KVConnector):
    role = "prefill"

    def __init__(self, config: KVTransferConfig, pool: KVPool, wake: Callable[[], None], agent=None):
        self.config = config
        self.pool = pool
        self.wake = wake
        self.agent, self.region_id = start_agent(config, pool, agent)
        self.layerwise = layerwise_enabled(config, pool.device)
        self.run_bytes = pool.run_bytes  # one (head, layer) run of a block: K and V of block_size tokens
        self._connects: dict[str, concurrent.futures.Future] = {}  # decode agent address -> dial (peer name)
        self._peers: dict[str, str] = {}  # decode agent address -> connected peer name
        self._layer_futs: dict[str, list[concurrent.futures.Future]] = {}
        self._pushes: dict[str, concurrent.futures.Future] = {}
        self._done: queue.SimpleQueue[ExportResult] = queue.SimpleQueue()
        self.num_layerwise = 0
        self.agent.on_peer_lost(self._on_peer_lost)

    def describe(self) -> dict:
        return {"role": self.role, "agent": self.agent.address, "region": POOL_REGION, "block_bytes": self.pool.block_bytes,
                "block_size": self.pool.block_size,
                "layout": asdict(self.pool.layout), "layerwise": self.layerwise}

    def has_events(self) -> bool:
        return not self._done.empty()

    def _on_peer_lost(self, peer: str, why: str) -> None:  # agent thread
        self._peers = {a: p for a, p in self._peers.items() if p != peer}

    # ---- connections: one per decode peer, made once and reused
    def on_added(self, req: Request) -> None:
        dest = req.kv_export.dest
        why = self.pool.layout.mismatch(dest.layout) if dest.layout is not None else None
        if why is not None:
            raise ValueError(why)
        address = dest.agent
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

    # ---- layer by layer, during the forward pass that completes the prompt
    def layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        if not self.layerwise:
            return None
        bs, bb = self.pool.block_size, self.pool.block_bytes
        todo = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            ex = req.kv_export
            if ex is None or req.num_computed_tokens + n != req.num_tokens:
                continue
            peer = self._connected(ex.dest.agent)
            if peer is None:
                continue  # not connected yet: this request is pushed whole after its prefill
            src = np.asarray(req.block_ids[ex.dest.start_block:num_prompt_blocks(req, bs)], dtype=np.int64)
            dst = np.asarray(ex.dest.block_ids, dtype=np.int64)
            if src.size == 0 or src.size != dst.size:
                continue
            remote_region = self.agent.peer_region_id(peer, ex.dest.region)
            self._layer_futs[req.request_id] = []
            todo.append((req.request_id, peer, src * bb, dst * bb, remote_region, ex.dest.request_id))
        if not todo:
            return None
        cuda = self.pool.device.type == "cuda"
        head_stride = self.pool.num_layers * self.run_bytes
        heads = np.arange(self.pool.num_kv_heads, dtype=np.int64) * head_stride
        layer_offsets = [heads + layer * self.run_bytes for layer in range(self.pool.num_layers)]

        def after_layer(layer: int) -> None:
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            off = layer_offsets[layer]  # the layer's run under each head of a block
            for rid, peer, src_off, dst_off, rr, key in todo:
                xl = XferList.build(self.region_id, (src_off[:, None] + off).ravel(), rr,
                                    (dst_off[:, None] + off).ravel(), self.run_bytes)
                self._layer_futs[rid].append(self.agent.write(peer, xl, None, wait_event=ev, coalesce=False,
                                                              key=key))

        return after_layer

    # ---- the push, after the first token was sampled
    def start_export(self, ex: ExportStart) -> None:
        req, dest = ex.req, ex.req.kv_export.dest
        rid = req.request_id
        layer_futs = self._layer_futs.pop(rid, None)
        src = req.block_ids[dest.start_block:num_prompt_blocks(req, self.pool.block_size)]
        if len(src) != len(dest.block_ids):
            self._report(ExportResult(rid, f"destination has {len(dest.block_ids)} blocks for {len(src)} blocks of KV"))
            return
        notif = {"request_id": dest.request_id, "first_token": ex.first_token,
                 "logprob": [ex.logprob[0], [list(t) for t in ex.logprob[1]]] if ex.logprob else None,
                 "t_prefill_done": ex.t_prefill_done, "num_blocks": len(src)}
        if layer_futs is not None and len(layer_futs) == self.pool.num_layers:
            fut = self.agent.submit(self._finish_layerwise(dest.agent, layer_futs, notif, dest.request_id))
            self.num_layerwise += 1
        else:
            fut = self.agent.submit(self._push(dest.agent, src, list(dest.block_ids), dest.region, notif,
                                               dest.request_id))
        self._pushes[rid] = fut
        fut.add_done_callback(lambda f, rid=rid: self._on_push_done(rid, f))

    async def _push(self, address: str, src: list[int], dst: list[int], region: str, notif: dict, key: str):
        """Write the blocks (coalesced runs) under the decode side's grant `key`, then notify."""
        peer = await self._peer_for(address)
        if not src:  # everything was a prefix hit on the decode side: only the notification travels
            await self.agent.agent.notify(peer, notif, key)
            return None
        return await self.agent.agent.write_blocks(peer, src, dst, self.pool.block_bytes, self.region_id, region,
                                                   notif, key=key)

    async def _finish_layerwise(self, address: str, futs: list, notif: dict, key: str):
        """Every layer landed: only now does the decode side hear of it (with the first token)."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        peer = await self._peer_for(address)
        await self.agent.agent.notify(peer, notif, key)
        return SimpleNamespace(seconds=time.perf_counter() - t0, nbytes=sum(r.nbytes for r in results),
                               transport=(results[0].transport if results else "none") + "/layerwise")

    def _on_push_done(self, rid: str, fut: concurrent.futures.Future) -> None:  # agent thread
        if fut.cancelled():
            self._report(ExportResult(rid, "the KV push was cancelled: its lease ran out"))
            return
        e = fut.exception()
        if e is not None:
            self._report(ExportResult(rid, f"KV push failed: {type(e).__name__}: {e}"))
            return
        r = fut.result()
        if r is None:
            self._report(ExportResult(rid, None, 0.0, 0, "notify"))
        else:
            self._report(ExportResult(rid, None, r.seconds, r.nbytes, r.transport))

    def _report(self, result: ExportResult) -> None:
        self._done.put(result)
        self.wake()

    def take_finished_exports(self) -> list[ExportResult]:
        out = []
        while True:
            try:
                r = self._done.get_nowait()
            except queue.Empty:
                return out
            self._pushes.pop(r.request_id, None)
            out.append(r)

    def cancel_export(self, request_id: str) -> None:
        fut = self._pushes.get(request_id)
        if fut is not None:
            fut.cancel()

    def stats(self) -> dict:
        return {"layerwise_exports": self.num_layerwise, "pushes_in_flight": len(self._pushes)}

    def close(self) -> None:
        try:
            self.agent.close()
        except Exception:  # closing on the way out: nothing left to tell
            log.debug("agent close failed", exc_info=True)


def layerwise_enabled(config: KVTransferConfig, device: torch.device) -> bool:
    """`auto`: push layer by layer where copies are slow enough to be worth overlapping with compute (tcp)."""
    if config.layerwise in ("on", "off"):
        return config.layerwise == "on"
    return config.transport == "tcp" or (config.transport == "auto" and device.type == "cpu")

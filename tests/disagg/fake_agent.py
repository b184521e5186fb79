"""An in-process stand-in for KV agents, so each PD side can be tested without sockets: agents on one `Fabric`
copy blocks between the tensors they registered and deliver real `Notification`s (msgpack payloads) on the
fabric's own thread, as a real agent delivers them on its thread. `Fabric.hold()` parks every push until
`release()`, to abort or expire things while a copy is in flight. Grants are enforced as the real agent enforces
them: a write or notification under a key the receiver did not grant (or revoked) is refused."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from pdserve.kv.errors import AccessDeniedError, PeerUnreachableError
from pdserve.kv.notify import Notification, encode_notif


class Fabric:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.agents: dict[str, FakeAgent] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.pushes = 0
        self.transport = "tcp"  # what the fabric stands in for (the transport agents choose for their peers)

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def agent(self, name: str) -> FakeAgent:
        a = FakeAgent(self, f"fake-{name}:1")
        self.agents[a.address] = a
        return a

    def close(self) -> None:
        self.gate.set()
        # let what was submitted last start (and the dials finish) before the loop stops: a coroutine submitted but
        # never started is reported as never awaited when it is collected, in whatever test runs then
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FakeAgent:
    """The slice of ThreadedAgent (and of the KVAgent under it) the PD sides use."""

    def __init__(self, fabric: Fabric, address: str) -> None:
        self.fabric = fabric
        self.address = address
        self.name = address
        self.agent = self  # the sides reach the async API as `.agent`
        self.regions: dict[int, Any] = {}
        self.names: dict[str, int] = {}
        self.notif_callbacks: list = []
        self.lost_callbacks: list = []
        self.grants: dict[str, tuple[set[int], int]] = {}  # key -> (block ids the key may write, block bytes)
        self.refused = 0
        self.connects = 0  # dials (connect calls) made
        self.closed = False
        self._xfer = 0

    # ---- ThreadedAgent surface
    def register(self, tensor, name: str | None = None, unit_bytes: int = 0) -> int:
        rid = len(self.regions)
        self.regions[rid] = tensor
        if name:
            self.names[name] = rid
        return rid

    def on_notification(self, cb) -> None:
        self.notif_callbacks.append(cb)

    def on_peer_lost(self, cb) -> None:
        self.lost_callbacks.append(cb)

    def lose(self, peer: str, why: str = "connection reset") -> None:
        """As a real agent does when a peer's control connection ends: tell the callbacks (on the agent's thread)."""
        for cb in self.lost_callbacks:
            self.fabric.loop.call_soon_threadsafe(cb, peer, why)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.fabric.loop)

    def grant_blocks(self, key: str, region, block_ids, block_bytes: int, mode: str, deadline: float,
                     peer: str | None = None) -> None:
        assert mode == "w" and deadline > time.time()
        self.grants[key] = (set(block_ids), block_bytes)

    def revoke(self, key: str) -> int:
        self.grants.pop(key, None)
        return 0

    def peer_address(self, peer: str) -> str:
        return peer  # a fake agent's name is its address

    def peer_region_id(self, peer: str, name: str) -> int:
        return self.fabric.agents[peer].names[name]

    def close(self) -> None:
        self.closed = True

    # ---- KVAgent (async) surface
    async def connect(self, address: str, timeout: float | None = None) -> str:
        if address not in self.fabric.agents:
            raise PeerUnreachableError(f"no fake agent at {address}")
        self.connects += 1
        return address

    def peer_transport(self, peer: str) -> dict:
        return {"transport": self.fabric.transport, "unavailable": {}}  # what the fabric stands in for

    async def notify(self, peer: str, payload: dict, key: str | None = None) -> None:
        self._check(peer, key, [])
        self._deliver(peer, encode_notif(payload), "notify", None, key)

    async def write(self, peer: str, xfers, notif: dict | None = None, *, key: str | None = None, **kw):
        """Copy each descriptor's bytes between the registered tensors (as raw bytes), then notify."""
        t0 = time.perf_counter()
        await asyncio.to_thread(self.fabric.gate.wait, 30)
        target = self.fabric.agents.get(peer)
        if target is None:
            raise PeerUnreachableError(f"no fake agent at {peer}")
        spans = list(zip(xfers.remote_offset.tolist(), xfers.length.tolist()))
        self._check(peer, key, spans)
        for lr, lo, rr, ro, n in zip(*(c.tolist() for c in (xfers.local_region, xfers.local_offset,
                                                              xfers.remote_region, xfers.remote_offset,
                                                              xfers.length))):
            src = self.regions[lr].view(-1).view(torch.uint8)
            dst = target.regions[rr].view(-1).view(torch.uint8)
            dst[ro:ro + n].copy_(src[lo:lo + n])
        self.fabric.pushes += 1
        if notif is not None:
            self._deliver(peer, encode_notif(notif), "write", None, key)
        return SimpleNamespace(seconds=time.perf_counter() - t0, nbytes=int(xfers.length.sum()),
                               transport=kw.get("transport") or self.fabric.transport)

    def _check(self, peer: str, key: str | None, spans: list[tuple[int, int]]) -> None:
        """Every (offset, length) span must lie inside one block the receiver granted to `key`."""
        target = self.fabric.agents[peer]
        grant = target.grants.get(key) if key is not None else None
        ok = grant is not None and all(
            off // grant[1] == (off + n - 1) // grant[1] and off // grant[1] in grant[0] for off, n in spans)
        if not ok:
            target.refused += 1
            raise AccessDeniedError(f"{peer} granted no write of {len(spans)} spans under key {key!r}")

    def _deliver(self, peer: str, payload: bytes, op: str, error: str | None, key: str | None) -> None:
        self._xfer += 1
        n = Notification(self.address, self._xfer, op, payload, time.perf_counter_ns(), error, key)
        for cb in self.fabric.agents[peer].notif_callbacks:
            cb(n)

    def inject(self, payload: bytes, error: str | None = None, sender: str = "fake-intruder:1",
               key: str | None = None) -> None:
        """Deliver a raw notification to this agent as if `sender` sent it (malformed-input tests)."""
        n = Notification(sender, 0, "notify", payload, time.perf_counter_ns(), error, key)
        for cb in self.notif_callbacks:
            cb(n)

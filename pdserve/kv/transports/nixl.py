"""nixl: hand the bytes to NIXL (UCX: RDMA across hosts, cuda_ipc within one) when its Python package is importable.

Multi-host RDMA needs an engine that already speaks InfiniBand/RoCE/EFA; NIXL is that engine. pdserve keeps its own
control plane (handshake, region tables, notifications on the control connection), and only the data movement goes
through a NIXL agent created beside ours: its metadata travels in our handshake, our regions are registered with it
once, and a transfer is one prepared descriptor list (coalesced by us first, which is what made NIXL fast in the
block-major measurement). The module is imported as `nixl_cu13`, `nixl_cu12` or `nixl`, whichever exists.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.kv.descs import XferList
from pdserve.kv.errors import KVTransferError, TransferTimeoutError
from pdserve.kv.transports.base import Transport

if TYPE_CHECKING:
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

_MODULES = ("nixl_cu13", "nixl_cu12", "nixl._api", "nixl")


def _nixl_module() -> Any:
    for name in _MODULES:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "nixl_agent"):
            return mod
    return None


def mem_type(kind: str) -> str:
    return "VRAM" if kind == "cuda" else "DRAM"


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        mod = _nixl_module()
        if mod is None:
            raise KVTransferError("no nixl module importable")
        self._nixl = mod.nixl_agent(agent.name, mod.nixl_agent_config(backends=["UCX"]))
        self._reg: dict[int, Any] = {}
        for r in agent.regions.all():
            self.on_register(r)

    @classmethod
    def available(cls) -> bool:
        return _nixl_module() is not None

    def on_register(self, region: MemoryRegion) -> None:
        dev = region.device if region.kind == "cuda" else 0
        self._reg[region.region_id] = self._nixl.register_memory([(region.ptr, region.size, dev, "")], mem_type(region.kind))

    def on_deregister(self, region: MemoryRegion) -> None:
        descs = self._reg.pop(region.region_id, None)
        if descs is not None:
            self._nixl.deregister_memory(descs)

    def export_region(self, region: MemoryRegion) -> dict[str, Any] | None:
        return {"addr": region.ptr, "dev": region.device if region.kind == "cuda" else 0}

    def hello_extra(self) -> dict[str, Any]:
        return {"nixl_meta": self._nixl.get_agent_metadata()}

    async def on_peer(self, peer: Peer) -> None:
        meta = peer.hello.get("nixl_meta")
        if meta is not None and peer.extra.get(self.name, {}).get("meta") != meta:
            if self.name in peer.extra:  # its memory changed: load the new metadata in place of the old
                self.on_peer_lost(peer)
            remote_name = self._nixl.add_remote_agent(meta)
            peer.extra[self.name] = {"meta": meta, "name": remote_name}

    def on_peer_lost(self, peer: Peer) -> None:
        st = peer.extra.pop(self.name, None)
        if st is not None:
            try:
                self._nixl.remove_remote_agent(st["name"])
            except Exception:
                pass

    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        if self.name not in peer.extra:
            return "peer runs no NIXL agent"
        if len({mem_type(r.kind) for r in local}) != 1 or len({mem_type(r.kind) for r in remote}) != 1:
            return "a NIXL transfer needs one memory type per side"
        if any("nixl" not in r.export for r in remote):
            return "remote region was registered without NIXL"
        return None

    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None) -> bool:
        if wait_event is not None:
            wait_event.synchronize()
        regions = self.agent.regions
        lregs = {int(r): regions.get(int(r)) for r in np.unique(xfers.local_region)}
        rregs = {int(r): peer.regions[int(r)] for r in np.unique(xfers.remote_region)}
        lbase = np.array([lregs[int(r)].ptr for r in xfers.local_region.tolist()], dtype=np.uint64)
        ldev = np.array([max(lregs[int(r)].device, 0) for r in xfers.local_region.tolist()], dtype=np.uint64)
        rbase = np.array([rregs[int(r)].export["nixl"]["addr"] for r in xfers.remote_region.tolist()], dtype=np.uint64)
        rdev = np.array([rregs[int(r)].export["nixl"]["dev"] for r in xfers.remote_region.tolist()], dtype=np.uint64)
        n = xfers.length.astype(np.uint64)
        ld = np.stack([lbase + xfers.local_offset.astype(np.uint64), n, ldev], 1)
        rd = np.stack([rbase + xfers.remote_offset.astype(np.uint64), n, rdev], 1)
        nx = self._nixl
        lt, rt = mem_type(next(iter(lregs.values())).kind), mem_type(next(iter(rregs.values())).kind)
        lh = nx.prep_xfer_dlist("NIXL_INIT_AGENT", ld, lt)
        rh = nx.prep_xfer_dlist(peer.extra[self.name]["name"], rd, rt)
        idx = np.arange(len(xfers), dtype=np.int32)
        h = nx.make_prepped_xfer(op.upper(), lh, idx, rh, idx, b"")
        try:
            state = nx.transfer(h)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"nixl {op} {xfer_id} with {peer.describe()} passed its deadline")
                await asyncio.sleep(0)
                state = nx.check_xfer_state(h)
            if state != "DONE":
                raise KVTransferError(f"nixl {op} {xfer_id} with {peer.describe()} ended in state {state}")
        finally:
            nx.release_xfer_handle(h)
            for d in (lh, rh):
                try:
                    nx.release_dlist_handle(d)
                except Exception:
                    pass
        return False

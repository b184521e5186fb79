"""nixl: hand the bytes to NIXL (UCX: RDMA across hosts, cuda_ipc within one) when its Python package is importable.

Multi-host RDMA needs an engine that already speaks InfiniBand/RoCE/EFA; NIXL is that engine. pdserve keeps its own
control plane (authenticated handshake, region tables, notifications on the control connection), and only the data
movement goes through a NIXL agent created beside ours: its metadata travels in our (authenticated) handshake, our
regions are registered with it once.

Driven at NIXL's own speed: descriptor lists are prepared once, not per transfer. A region registered with
`unit_bytes` gets one prepared list of all its units (local side at registration, each peer's side when its region
table arrives); a transfer is then a pair of index lists into those (NIXL merges consecutive entries back into
large runs). Transfers whose runs do not fall on unit boundaries, or regions registered without a unit, take the
slow path: a descriptor list prepared for that transfer alone.

One-sided: the peer's NIXL agent reads and writes our registered memory without our agent seeing the descriptors,
so grants cannot fence NIXL transfers per block. Authentication gates who receives our NIXL metadata at all, and
notifications still go through the grant check of their key. The module is imported as `nixl_cu13`, `nixl_cu12`
or `nixl`, whichever exists.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.kv.descs import XferList, distinct
from pdserve.kv.errors import KVTransferError, TransferTimeoutError
from pdserve.kv.transports.base import Transport

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

log = logging.getLogger(__name__)
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl._api", "nixl")
_LOCAL = "NIXL_INIT_AGENT"


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


@dataclass
class Prepped:
    """A prepared descriptor list covering a whole region, one entry per unit."""

    handle: Any
    unit: int
    count: int


def unit_rows(base: int, size: int, unit: int, dev: int) -> np.ndarray:
    n = size // unit
    if n >= 1 << 31:
        raise KVTransferError(f"{n} units of {unit} bytes do not fit NIXL's int32 indices; use a larger unit")
    rows = np.empty((n, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(unit)
    rows[:, 1] = unit
    rows[:, 2] = dev
    return rows


def unit_indices(offset: np.ndarray, length: np.ndarray, unit: int) -> np.ndarray | None:
    """Indices of the units the runs (offset, length) cover, in order; None if a run is not unit-aligned."""
    if (offset % unit).any() or (length % unit).any():
        return None
    counts = length // unit
    first = np.cumsum(counts) - counts
    idx = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts) + np.repeat(offset // unit, counts)
    return idx.astype(np.int32)


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        mod = _nixl_module()
        if mod is None:
            raise KVTransferError("no nixl module importable")
        self._nixl = mod.nixl_agent(ctx.name, mod.nixl_agent_config(backends=["UCX"]))
        self._reg: dict[int, Any] = {}
        self._local: dict[int, Prepped] = {}
        self._slow_logged = False
        for r in ctx.regions.all():
            self.on_register(r)

    @classmethod
    def available(cls) -> bool:
        return _nixl_module() is not None

    def on_register(self, region: MemoryRegion) -> None:
        dev = region.device if region.kind == "cuda" else 0
        self._reg[region.region_id] = self._nixl.register_memory([(region.ptr, region.size, dev, "")], mem_type(region.kind))
        if region.unit:
            rows = unit_rows(region.ptr, region.size, region.unit, dev)
            self._local[region.region_id] = Prepped(self._nixl.prep_xfer_dlist(_LOCAL, rows, mem_type(region.kind)),
                                                    region.unit, len(rows))

    def on_deregister(self, region: MemoryRegion) -> None:
        p = self._local.pop(region.region_id, None)
        if p is not None:
            self._release_dlist(p.handle)
        descs = self._reg.pop(region.region_id, None)
        if descs is not None:
            self._nixl.deregister_memory(descs)

    def export_region(self, region: MemoryRegion) -> dict[str, Any] | None:
        return {"addr": region.ptr, "dev": region.device if region.kind == "cuda" else 0}

    def hello_extra(self) -> dict[str, Any]:
        return {"nixl_meta": self._nixl.get_agent_metadata()}

    async def on_peer(self, peer: Peer) -> None:
        meta = peer.hello.get("nixl_meta")
        if not isinstance(meta, bytes):
            return
        st = peer.extra.get(self.name)
        if st is not None and st["meta"] != meta:  # its memory changed: load the new metadata in place of the old
            self.on_peer_lost(peer)
            st = None
        if st is None:
            st = peer.extra[self.name] = {"meta": meta, "name": self._nixl.add_remote_agent(meta), "dlists": {}}
        dlists: dict[int, Prepped] = st["dlists"]
        for rid in [r for r in dlists if r not in peer.regions]:
            self._release_dlist(dlists.pop(rid).handle)
        for rid, r in peer.regions.items():
            e = r.export.get("nixl")
            if rid in dlists or not r.unit or not isinstance(e, dict):
                continue
            addr, dev = e.get("addr"), e.get("dev")
            if type(addr) is not int or type(dev) is not int or addr < 0 or dev < 0:
                continue
            rows = unit_rows(addr, r.size, r.unit, dev)
            dlists[rid] = Prepped(self._nixl.prep_xfer_dlist(st["name"], rows, mem_type(r.kind)), r.unit, len(rows))

    def on_peer_lost(self, peer: Peer) -> None:
        st = peer.extra.pop(self.name, None)
        if st is None:
            return
        for p in st["dlists"].values():
            self._release_dlist(p.handle)
        try:
            self._nixl.remove_remote_agent(st["name"])
        except Exception as e:  # the remote agent may already be gone
            log.debug("nixl: removing remote agent %s: %s", st["name"], e)

    def _release_dlist(self, handle: Any) -> None:
        try:
            self._nixl.release_dlist_handle(handle)
        except Exception as e:
            log.debug("nixl: releasing a descriptor list: %s", e)

    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        if self.name not in peer.extra:
            return "peer runs no NIXL agent"
        if len({mem_type(r.kind) for r in local}) != 1 or len({mem_type(r.kind) for r in remote}) != 1:
            return "a NIXL transfer needs one memory type per side"
        if any("nixl" not in r.export for r in remote):
            return "remote region was registered without NIXL"
        return None

    def _request(self, op: str, peer: Peer, x: XferList) -> tuple[Any, list[Any]]:
        """One NIXL request for descriptors between one local and one remote region: index lists into the
        prepared lists when the runs are unit-aligned, else descriptor lists prepared for this request (returned
        for release)."""
        nx = self._nixl
        st = peer.extra[self.name]
        lr, rr = int(x.local_region[0]), int(x.remote_region[0])
        lp, rp = self._local.get(lr), st["dlists"].get(rr)
        if lp is not None and rp is not None and lp.unit == rp.unit:
            li = unit_indices(x.local_offset, x.length, lp.unit)
            ri = unit_indices(x.remote_offset, x.length, rp.unit)
            if li is not None and ri is not None:
                return nx.make_prepped_xfer(op.upper(), lp.handle, li, rp.handle, ri, b""), []
        if not self._slow_logged:
            self._slow_logged = True
            log.info("nixl: a transfer between regions %d and %d is not unit-aligned (or no unit_bytes was "
                     "registered); preparing its descriptor list per transfer", lr, rr)
        lreg, rreg = self.ctx.regions.get(lr), peer.regions[rr]
        e = rreg.export["nixl"]
        n = x.length.astype(np.uint64)
        ld = np.stack([np.uint64(lreg.ptr) + x.local_offset.astype(np.uint64), n,
                       np.full(len(x), max(lreg.device, 0), np.uint64)], 1)
        rd = np.stack([np.uint64(e["addr"]) + x.remote_offset.astype(np.uint64), n,
                       np.full(len(x), e["dev"], np.uint64)], 1)
        lh = nx.prep_xfer_dlist(_LOCAL, ld, mem_type(lreg.kind))
        rh = nx.prep_xfer_dlist(st["name"], rd, mem_type(rreg.kind))
        idx = np.arange(len(x), dtype=np.int32)
        return nx.make_prepped_xfer(op.upper(), lh, idx, rh, idx, b""), [lh, rh]

    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None, key: str | None = None) -> bool:
        if wait_event is not None:  # off the agent's loop: a push ahead waits for a whole prefill step
            await asyncio.get_running_loop().run_in_executor(None, wait_event.synchronize)
        nx = self._nixl
        pairs = [(lr, rr) for lr in distinct(xfers.local_region) for rr in distinct(xfers.remote_region)]
        reqs: list[tuple[Any, list[Any]]] = []
        try:
            for lr, rr in pairs:
                x = xfers if len(pairs) == 1 else xfers.take((xfers.local_region == lr) & (xfers.remote_region == rr))
                if len(x):
                    reqs.append(self._request(op, peer, x))
            states = [nx.transfer(h) for h, _ in reqs]
            while any(s == "PROC" for s in states):
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"nixl {op} {xfer_id} with {peer.describe()} passed its deadline")
                await asyncio.sleep(0)
                states = [s if s != "PROC" else nx.check_xfer_state(h) for s, (h, _) in zip(states, reqs)]
            bad = [s for s in states if s != "DONE"]
            if bad:
                raise KVTransferError(f"nixl {op} {xfer_id} with {peer.describe()} ended in state {bad[0]}")
        finally:
            for h, own in reqs:
                nx.release_xfer_handle(h)
                for d in own:
                    self._release_dlist(d)
        return False

"""mooncake: hand the bytes to Mooncake Transfer Engine (RDMA across hosts, or its own TCP), when installed.

Optional dependency (`pip install 'pdserve[mooncake]'`: mooncake-transfer-engine; -cuda13 for torch built for
CUDA 13, -non-cuda on a machine without GPUs, which also needs libibverbs1). Imported only when the transport is
asked for; a missing library, a missing RDMA device or a device name that does not exist is one clear error at
start-up, never a silent fallback (Mooncake itself quietly uses TCP when it finds no RDMA device: we check).

pdserve keeps its own control plane: Mooncake runs with its peer-to-peer handshake (`metadata="p2p"`, the default)
or etcd (`metadata="etcd"`, the agent's own option); its segment name travels in our authenticated handshake; the
pool is registered with it once; a transfer is one batch of coalesced block runs (`batch_transfer_sync_write` /
`_read`, in a helper thread: the call blocks until the batch completed, which for Mooncake's TCP means applied at
the destination, for RDMA acknowledged by the remote NIC). Only then does the agent notify the peer, on our
authenticated control connection; Mooncake's own notifications are not used. Devices and protocol are configuration
(`AgentConfig.devices`, `.protocol`; flags --kv-devices, --kv-protocol): no code patch.

Fencing (README, Security): Mooncake's ports (its handshake port and, with protocol tcp, its data port) accept
anyone; whoever reaches them can read and write every buffer registered with it, which here is the KV pool. Like
NIXL, per-block grants cannot fence it; notifications still pass the grant check of their key. Use it only where
every process that can reach those ports is trusted (a dedicated fabric, a network namespace, a firewall).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np

from pdserve.kv.descs import XferList
from pdserve.kv.errors import KVTransferError, PeerDisconnectedError, TransferTimeoutError, TransportUnavailableError
from pdserve.kv.transports.base import Transport

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

log = logging.getLogger(__name__)
INSTALL = ("pip install 'pdserve[mooncake]' (the mooncake-transfer-engine package; mooncake-transfer-engine-cuda13 "
           "for torch built for CUDA 13, mooncake-transfer-engine-non-cuda without a GPU)")


def load_engine() -> Any:
    """Mooncake's TransferEngine class, or TransportUnavailableError saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        if "libibverbs" in str(e) or "librdmacm" in str(e):
            raise TransportUnavailableError(f"transport mooncake: Mooncake is installed but cannot load {e}; install "
                                            "the verbs library (Debian/Ubuntu: apt-get install libibverbs1)") from e
        raise TransportUnavailableError(f"transport mooncake needs Mooncake Transfer Engine: {INSTALL} ({e})") from e
    return TransferEngine


def hcas(topology_json: str) -> set[str]:
    """RDMA devices (HCAs) named in Mooncake's local topology ({"cpu:0": [[preferred], [others]], ...})."""
    try:
        topo = json.loads(topology_json)
    except ValueError:
        return set()
    out: set[str] = set()
    for lists in topo.values() if isinstance(topo, dict) else ():
        for names in lists if isinstance(lists, list) else ():
            if isinstance(names, list):
                out.update(n for n in names if isinstance(n, str))
    return out


def _metadata(cfg: Any) -> str:
    if cfg.metadata == "p2p":
        return "P2PHANDSHAKE"
    u = urlparse(cfg.etcd_url)
    return f"etcd://{u.netloc or u.path}"


def _host(cfg: Any) -> str:
    h = cfg.advertise_host or cfg.host
    if h in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return h


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        engine_cls = load_engine()
        # Mooncake's own per-batch timeout (seconds, at least 5, plus 1 ns per byte): near our io timeout, so a
        # transfer to a dead peer does not hold a helper thread much longer than the agent waits for it
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(cfg.io_timeout_s))))
        self._te = engine_cls()
        host = _host(cfg)
        meta = _metadata(cfg)
        local = host if meta == "P2PHANDSHAKE" else f"{host}:{_free_port(host)}"
        devices = ",".join(cfg.device_list)
        rc = self._te.initialize(local, meta, cfg.protocol, devices)
        if rc != 0:
            raise TransportUnavailableError(f"transport mooncake: TransferEngine.initialize({local!r}, {meta!r}, "
                                            f"{cfg.protocol!r}, {devices!r}) returned {rc} (Mooncake's log above says "
                                            "why)")
        if cfg.protocol == "rdma":
            found = hcas(self._te.get_local_topology(devices) if devices else self._te.get_local_topology())
            missing = [d for d in cfg.device_list if d not in found]
            if not found or missing:
                what = f"RDMA device(s) {', '.join(missing)} not found" if missing else "no RDMA device found"
                raise TransportUnavailableError(
                    f"transport mooncake with protocol rdma: {what} (found: {sorted(found) or 'none'}; "
                    "/sys/class/infiniband lists them); name them with --kv-devices (AgentConfig.devices), or use "
                    "--kv-protocol tcp")
        self.segment = f"{host}:{self._te.get_rpc_port()}" if meta == "P2PHANDSHAKE" else local
        self._threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-mooncake")
        self._lost: dict[str, asyncio.Future] = {}
        self._registered: dict[int, int] = {}
        log.warning("mooncake (%s, %s): Mooncake listens without authentication (handshake port %d%s); any process "
                    "that can reach it can read and write the registered KV pool: use it only where every such process "
                    "is trusted (pdserve/kv/README.md, Security)", cfg.protocol, meta, self._te.get_rpc_port(),
                    ", and a TCP data port" if cfg.protocol == "tcp" else "")
        for r in ctx.regions.all():
            self.on_register(r)

    def hello_extra(self) -> dict[str, Any]:
        return {"mooncake": {"seg": self.segment, "proto": self.ctx.config.protocol}}

    def on_register(self, region: MemoryRegion) -> None:
        location = f"cuda:{region.device}" if region.kind == "cuda" else "cpu:0"
        rc = self._te.register_memory(region.ptr, region.size, location)
        if rc != 0:
            raise KVTransferError(f"mooncake could not register region {region.name} ({region.size} bytes, "
                                  f"{location}): register_memory returned {rc}")
        self._registered[region.region_id] = region.ptr

    def on_deregister(self, region: MemoryRegion) -> None:
        ptr = self._registered.pop(region.region_id, None)
        if ptr is not None:
            self._te.unregister_memory(ptr)

    def export_region(self, region: MemoryRegion) -> dict[str, Any] | None:
        return {"addr": region.ptr}

    def _peer_info(self, peer: Peer) -> dict[str, Any] | None:
        info = peer.hello.get("mooncake")
        if not isinstance(info, dict) or not isinstance(info.get("seg"), str) or len(info["seg"]) > 300:
            return None
        return info

    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        info = self._peer_info(peer)
        if info is None:
            return "peer runs no mooncake transport"
        if info.get("proto") != self.ctx.config.protocol:
            return f"peer's Mooncake uses protocol {info.get('proto')!r}, ours {self.ctx.config.protocol!r}"
        for r in remote:
            e = r.export.get("mooncake")
            if not isinstance(e, dict) or type(e.get("addr")) is not int or e["addr"] <= 0:
                return f"remote region {r.region_id} is not registered with Mooncake"
        return None

    async def on_peer(self, peer: Peer) -> None:
        if peer.name not in self._lost:
            self._lost[peer.name] = asyncio.get_running_loop().create_future()

    def on_peer_lost(self, peer: Peer) -> None:
        fut = self._lost.pop(peer.name, None)
        if fut is not None and not fut.done():
            fut.set_exception(PeerDisconnectedError(f"{peer.describe()} disconnected: {peer.lost_reason}"))
            fut.exception()

    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None, key: str | None = None) -> bool:
        # one-sided: the peer's memory is written by Mooncake without our agent on the other side seeing the runs,
        # so grants cannot fence it; the notification the agent sends after this returns passes the key's check
        loop = asyncio.get_running_loop()
        seg = self._peer_info(peer)["seg"]  # type: ignore[index]
        regions = self.ctx.regions
        lbase = np.array([regions.get(int(r)).ptr for r in xfers.local_region.tolist()], dtype=np.int64)
        rbase = np.array([peer.regions[int(r)].export["mooncake"]["addr"] for r in xfers.remote_region.tolist()],
                         dtype=np.int64)
        local = (lbase + xfers.local_offset).tolist()
        remote = (rbase + xfers.remote_offset).tolist()
        lengths = xfers.length.tolist()
        call = self._te.batch_transfer_sync_write if op == "write" else self._te.batch_transfer_sync_read

        def run() -> int:
            if wait_event is not None:
                wait_event.synchronize()
            return call(seg, local, remote, lengths)

        work = loop.run_in_executor(self._threads, run)
        lost = self._lost.get(peer.name)
        waits = {work} if lost is None else {work, lost}
        done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            if lost is not None and lost in done:
                raise PeerDisconnectedError(f"mooncake {op} {xfer_id}: {peer.describe()} disconnected: "
                                            f"{peer.lost_reason}")
            raise TransferTimeoutError(f"mooncake {op} {xfer_id} with {peer.describe()} did not finish before its "
                                       "deadline")
        rc = work.result()
        if rc != 0:
            if not peer.alive:
                raise PeerDisconnectedError(f"mooncake {op} {xfer_id}: {peer.describe()} disconnected: "
                                            f"{peer.lost_reason}")
            raise KVTransferError(f"mooncake {op} {xfer_id} with {peer.describe()} (segment {seg}) failed: Mooncake "
                                  f"returned {rc} (its log says why: a dead peer, an address outside its registered "
                                  "buffers, a transport error)")
        return False

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for rid in list(self._registered):
            ptr = self._registered.pop(rid)
            try:
                self._te.unregister_memory(ptr)
            except Exception as e:  # closing: nothing left to tell
                log.debug("mooncake: unregistering %#x: %s", ptr, e)

"""The transfer agent: one per process. Registers memory, connects to peers, moves descriptor lists, notifies.

Lifecycle: `register()` memory once (the KV pool is one tensor), `await start()` to listen on one port (control and
data connections share it), `await connect("host:port")` to handshake with a peer (region tables and transport
information are exchanged once; the control connection stays open), then `await write(...)` / `await read(...)`
as often as needed. The receiver learns that data landed through a notification (`on_notification` callback or
`await wait_notification(...)`), which is only sent after the bytes are in its memory.

Every wait is bounded (connect, transfer deadline, notification wait), a lost control connection marks the peer
dead at once and fails whoever waits on it, and registered regions stay valid whatever happens to a transfer.

Security (README, "Security"): every connection proves the deployment secret (`AgentConfig.secret`) before it
learns anything; incoming transfers and notifications are checked against the grants the engine made for each
request (`grant`, `revoke`); whatever a peer sends is validated at the edge and can fail only its own transfer or
connection, never the agent.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.kv import frames
from pdserve.kv.auth import Session
from pdserve.kv.config import AgentConfig
from pdserve.kv.context import TransportContext
from pdserve.kv.control import accept_hello, open_control
from pdserve.kv.descs import XferList, block_xfers, distinct, validate
from pdserve.kv.errors import (
    KVConfigError,
    KVTransferError,
    LimitExceededError,
    PeerDisconnectedError,
    PeerUnreachableError,
    TransportUnavailableError,
)
from pdserve.kv.grants import Grants, check_key
from pdserve.kv.listener import Listener
from pdserve.kv.metadata import make_metadata
from pdserve.kv.notify import Notification, Notifications, encode_notif
from pdserve.kv.nvtx import mark, nvtx_range
from pdserve.kv.peer import Peer, read_frame
from pdserve.kv.regions import MemoryRegion, RegionTable, RemoteRegion, host_id
from pdserve.kv.transports import build_transports
from pdserve.kv.transports.base import Transport
from pdserve.kv.transports.tcp_io import split_address
from pdserve.kv.wire import ProtocolError

log = logging.getLogger(__name__)
_FAILED_SEEN = 4096  # failure reports remembered per agent, so one failed transfer is reported once
_AUTO_ORDER = ("cuda_ipc", "nixl", "tcp")  # what `auto` tries, fastest first (mooncake and nccl only when named)


@dataclass(frozen=True)
class XferResult:
    xfer_id: int
    peer: str
    op: str
    transport: str
    nbytes: int
    descs_in: int
    descs_out: int  # after coalescing
    seconds: float


class KVAgent:
    def __init__(self, config: AgentConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            raise TypeError("pass either an AgentConfig or keyword overrides, not both")
        self.config = cfg = config or AgentConfig(**overrides)
        if cfg.secret is None and not cfg.insecure:
            raise KVConfigError("KV agent has no secret and will not listen without one: set AgentConfig.secret "
                                "(pdserve.secret.load_secret reads --deployment-secret-file, "
                                "PDSERVE_DEPLOYMENT_SECRET, PDSERVE_DEPLOYMENT_SECRET_FILE), or insecure=True for "
                                "an open port (tests only)")
        self.name = cfg.name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.host_id = host_id()
        self.regions = RegionTable()
        self.grants = Grants(cfg.max_grants, cfg.max_grant_s)
        self._ctx = TransportContext(cfg, self.name, self.host_id, self.regions, self.grants, self.deliver_threadsafe,
                                     self._peer_regions)
        self.transports: dict[str, Transport] = build_transports(self._ctx)
        self._peers: dict[str, Peer] = {}
        self._ids = itertools.count(1)
        self._notes = Notifications(cfg.max_queued_notifications)
        self._failed_seen: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._lost_callbacks: list[Callable[[str, str], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listen: Listener | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._address = ""
        self._meta = make_metadata(cfg)

    # ---- memory ------------------------------------------------------------------------------------------------
    def register(self, obj: Any, name: str | None = None, unit_bytes: int = 0) -> int:
        """Register a torch tensor (CPU, pinned or CUDA), numpy array or bytearray; returns its region id.

        `unit_bytes`: the smallest run transfers of this region move (a KV block, or a block's slice of one layer
        for layer-wise pushes); it must divide the region. NIXL prepares its descriptor lists once at that
        granularity, so a transfer costs an index list instead of a descriptor list."""
        reg = self.regions.add(obj, name, unit_bytes)
        for t in self.transports.values():
            t.on_register(reg)
        self._regions_changed()
        return reg.region_id

    def deregister(self, region_id: int) -> None:
        reg = self.regions.remove(region_id)
        for t in self.transports.values():
            t.on_deregister(reg)
        self._regions_changed()

    def descriptor(self) -> dict[str, Any]:
        """What this agent publishes: name, address, host identity and its region table (as peers see it)."""
        return {"name": self.name, "address": self._address, "host_id": self.host_id,
                "transports": sorted(self.transports), "regions": self._describe_regions()}

    def region(self, region_id: int) -> MemoryRegion:
        return self.regions.get(region_id)

    def _describe_regions(self) -> list[dict[str, Any]]:
        out = []
        for reg in self.regions.all():
            d = reg.describe()
            d["export"] = {t.name: e for t in self.transports.values() if (e := t.export_region(reg)) is not None}
            out.append(d)
        return out

    def _peer_regions(self, peer: str) -> Mapping[int, RemoteRegion]:
        p = self._peers.get(peer)
        return dict(p.regions) if p is not None and p.alive else {}

    def _regions_changed(self) -> None:
        loop = self._loop
        if loop is None or self._closed or not self._peers:
            return

        def kick() -> None:
            self._spawn(self._broadcast_regions())

        loop.call_soon_threadsafe(kick)

    async def _broadcast_regions(self) -> None:
        for p in list(self._peers.values()):
            try:
                await p.send({"t": "regions", "regions": self._describe_regions(), "extra": self._extra()})
            except KVTransferError as e:
                log.warning("cannot send region table to %s: %s", p.describe(), e)

    # ---- grants --------------------------------------------------------------------------------------------------
    def grant(self, key: str, region: int | str, ranges: Any, mode: str, deadline: float,
              peer: str | None = None) -> None:
        """Let `peer` (any authenticated peer when None) write ("w") or read ("r") the byte ranges
        [(offset, length), ...] of our `region` (id or name) in transfers under `key` (the request id) until
        `deadline` (time.time()). Notifications for `key` are delivered only from peers a live grant admits (an
        empty `ranges` admits notifications only). Thread-safe and cheap: call it from the engine loop."""
        reg = self.regions.by_name(region) if isinstance(region, str) else self.regions.get(int(region))
        self.grants.add(key, reg.region_id, reg.size, ranges, mode, deadline, peer)

    def grant_blocks(self, key: str, region: int | str, block_ids: Any, block_bytes: int, mode: str,
                     deadline: float, peer: str | None = None) -> None:
        """`grant` for whole blocks of a block-major pool."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        self.grant(key, region, np.stack([ids * block_bytes, np.full(ids.size, block_bytes, np.int64)], 1), mode,
                   deadline, peer)

    def revoke(self, key: str) -> int:
        """End every grant of `key` (idempotent). Returns how many incoming tcp copies under it are still running
        (they passed their check before the revoke; one-sided transports cannot be counted or stopped)."""
        return self.grants.revoke(key)

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._address

    @property
    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    def port_stats(self) -> dict[str, Any]:
        """Open incoming connections (total, unauthenticated, per peer): what the bounds of AgentConfig limit."""
        return self._listen.stats() if self._listen is not None else {"connections": 0, "pending": 0, "per_peer": {}}

    async def start(self) -> str:
        """Listen for peers; returns the address they should dial ("host:port")."""
        if self._loop is not None:
            return self._address
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        self._listen = Listener(cfg, self.name, on_control=self._serve_ctrl,
                                on_data=self.transports["tcp"].serve)  # type: ignore[attr-defined]
        self._listen.start()
        host = cfg.advertise_host or (cfg.host if cfg.host not in ("0.0.0.0", "::", "") else _my_ip())
        port = self._listen.port
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._meta is not None:
            await self._meta.publish(self.name, {"address": self._address, "host_id": self.host_id})
        return self._address

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in list(self._peers.values()):
            try:
                await p.send({"t": "bye"})
            except KVTransferError:
                pass
            self._peer_lost(p, "local agent closed")
            p.writer.close()
        if self._listen is not None:
            await self._listen.close()
        for t in self.transports.values():
            await t.close()
        self._notes.close()
        for task in list(self._tasks):
            task.cancel()
        if self._meta is not None:
            await self._meta.close(self.name)

    async def __aenter__(self) -> KVAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- control connections -----------------------------------------------------------------------------------
    def _extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for t in self.transports.values():
            extra.update(t.hello_extra())
        return extra

    def _hello(self, kind: str) -> dict[str, Any]:
        return {"t": kind, "address": self._address, "host_id": self.host_id, "pid": os.getpid(),
                "transports": sorted(self.transports), "regions": self._describe_regions(), "extra": self._extra()}

    def _make_peer(self, session: Session, info: frames.Hello, writer: asyncio.StreamWriter) -> Peer:
        return Peer(name=session.peer, address=info.address, host_id=info.host_id, pid=info.pid,
                    transports=info.transports, writer=writer, session=session, regions=info.regions,
                    hello=dict(info.extra), io_timeout=self.config.io_timeout_s)

    async def _serve_ctrl(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Session) -> None:
        """An authenticated incoming control connection, for its whole life (owned by the listener's task)."""
        try:
            info = await accept_hello(reader, writer, session, self.config, self._hello("hello_ok"))
        except (asyncio.TimeoutError, frames.FrameError) as e:
            log.warning("control handshake with peer %s failed: %s", session.peer, e)
            return
        peer = self._make_peer(session, info, writer)
        await self._add_peer(peer)
        await self._reader_loop(peer, reader)

    async def _add_peer(self, peer: Peer) -> None:
        old = self._peers.get(peer.name)
        self._peers[peer.name] = peer
        if old is not None and old is not peer:
            old.alive = False
            old.writer.close()
        await self._transports_on_peer(peer)

    async def _transports_on_peer(self, peer: Peer) -> None:
        for t in self.transports.values():
            try:
                await t.on_peer(peer)
                peer.extra.get("why_not", {}).pop(t.name, None)
            except Exception as e:  # a transport that cannot map this peer is not chosen for it (and that is said)
                peer.extra.setdefault("why_not", {})[t.name] = f"{type(e).__name__}: {e}"
                log.debug("transport %s cannot serve %s: %s", t.name, peer.describe(), e)
        self._say_transport(peer)

    def _say_transport(self, peer: Peer) -> None:
        """One log line per peer (and per change) naming the transport its transfers of the KV pool take, and why
        no faster one serves: never a silent slow path."""
        choice = self.peer_transport(peer.name)
        said = (choice["transport"], tuple(sorted(choice["unavailable"].items())))
        if not peer.regions or peer.extra.get("said") == said:
            return
        peer.extra["said"] = said
        if choice["unavailable"]:
            log.warning("KV %s: transfers use %s; %s", peer.describe(), choice["transport"],
                        "; ".join(f"{k} cannot serve: {v}" for k, v in choice["unavailable"].items()))
        else:
            log.info("KV %s: transfers use %s", peer.describe(), choice["transport"])

    def peer_transport(self, peer: str) -> dict[str, Any]:
        """Which transport transfers between our regions and `peer`'s take, and why each faster one cannot:
        {"transport": name or "none", "unavailable": {faster transport: reason}} (what /metrics shows per peer).
        Faster means earlier in the automatic order (cuda_ipc, nixl, tcp) among those this process started, or the
        forced transport."""
        p = self._peers.get(peer)
        if p is None or not p.alive:
            raise PeerDisconnectedError(f"not connected to peer {peer!r}")
        local, remote = self.regions.all(), list(p.regions.values())
        if not local or not remote:
            return {"transport": "none", "unavailable": {}}
        errors = p.extra.get("why_not", {})
        order = [self.config.transport] if self.config.transport != "auto" else list(_AUTO_ORDER)
        unavailable: dict[str, str] = {}
        for name in order:
            tr = self.transports.get(name)
            forced = name == self.config.transport
            if not forced and (tr is None or not tr.applies(local, remote)):
                continue  # not started here (not installed, no GPU) or not meant for this memory: nothing lost
            why = errors.get(name) or (tr.supports(p, local, remote) if tr is not None else
                                       "not available in this process")
            if not why:
                return {"transport": name, "unavailable": unavailable}
            unavailable[name] = why
        return {"transport": "none", "unavailable": unavailable}

    def peer_transports(self) -> dict[str, dict[str, Any]]:
        """`peer_transport` for every connected peer, by peer name."""
        return {name: self.peer_transport(name) for name, p in list(self._peers.items()) if p.alive}

    async def connect(self, target: str, timeout: float | None = None) -> str:
        """Handshake with the agent at `target` ("host:port", or a name when a metadata backend is configured);
        returns the peer's name. Connecting to an already connected address returns at once. A peer that does
        not prove the deployment secret raises PeerAuthenticationError ("KV peer authentication failed: ...")."""
        if self._loop is None:
            await self.start()
        timeout = timeout or self.config.connect_timeout_s
        address = await self._resolve(target, timeout)
        for p in self._peers.values():
            if p.address == address and p.alive:
                return p.name
        host, port = split_address(address)
        try:
            reader, writer, session, info = await asyncio.wait_for(
                open_control(self.config, self.name, host, port, address, self._hello("hello")), timeout)
        except asyncio.TimeoutError as e:
            raise PeerUnreachableError(f"cannot connect to KV agent at {address}: timed out after {timeout:g} s") from e
        peer = self._make_peer(session, info, writer)
        await self._add_peer(peer)
        self._spawn(self._reader_loop(peer, reader))
        return peer.name

    async def _resolve(self, target: str, timeout: float) -> str:
        host, _, port = target.rpartition(":")
        if host and port.isdigit():
            return target
        if self._meta is None:
            raise PeerUnreachableError(f"{target!r} is not host:port and no metadata backend (etcd) is configured")
        info = await asyncio.wait_for(self._meta.lookup(target), timeout)
        if not info:
            raise PeerUnreachableError(f"no KV agent named {target!r} in {self.config.metadata} metadata")
        return str(info["address"])

    def peer(self, name: str) -> Peer:
        p = self._peers.get(name)
        if p is None or not p.alive:
            raise PeerDisconnectedError(f"not connected to peer {name!r} (connected: {sorted(self._peers)})")
        return p

    async def _reader_loop(self, peer: Peer, reader: asyncio.StreamReader) -> None:
        reason = "connection closed"
        try:
            while True:
                msg = await read_frame(reader, peer.session, self.config.max_frame_bytes)
                if msg["t"] == "bye":
                    reason = "peer closed its agent"
                    break
                try:
                    await self._on_frame(peer, msg)
                except frames.FrameError as e:
                    log.warning("dropped a malformed %r frame from %s: %s", msg["t"][:32], peer.describe(), e)
                except Exception:  # a bug handling one frame: drop the frame, keep the connection and the agent
                    log.exception("handling a %r frame from %s failed", msg["t"][:32], peer.describe())
        except asyncio.IncompleteReadError:
            reason = "connection closed by peer (process exited or crashed?)"
        except ProtocolError as e:
            reason = f"protocol violation: {e}"
            log.warning("closing the control connection of %s: %s", peer.describe(), e)
        except (ConnectionError, OSError) as e:
            reason = f"control connection failed: {e}"
        except asyncio.CancelledError:
            reason = "local agent closed"
            raise
        finally:
            self._peer_lost(peer, reason)

    async def _on_frame(self, peer: Peer, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t in ("notif", "failed"):
            n = frames.note(msg, self.config.max_notif_bytes)
            self._deliver(Notification(peer.name, n.xfer_id, n.op, n.payload, time.perf_counter_ns(), n.error, n.key))
        elif t == "regions":
            peer.regions, extra = frames.region_update(msg)
            peer.hello.update(extra)
            await self._transports_on_peer(peer)
        elif t == "tp":  # a transport's own message (side-channel set-up, a two-sided transfer's request)
            name, body = frames.transport_message(msg)
            tr = self.transports.get(name)
            if tr is None:
                raise frames.FrameError(f"a message for transport {name[:32]!r}, which this agent does not run")
            await tr.on_message(peer, body)
        else:
            log.debug("ignored a control frame of unknown type %r from %s", t[:32], peer.describe())

    def _peer_lost(self, peer: Peer, reason: str) -> None:
        if self._peers.get(peer.name) is not peer:
            return
        del self._peers[peer.name]
        peer.alive = False
        peer.lost_reason = reason
        peer.writer.close()
        for t in self.transports.values():
            try:
                t.on_peer_lost(peer)
            except Exception:
                log.exception("transport %s failed to forget %s", t.name, peer.describe())
        self._notes.fail_peer(peer.name, f"{peer.describe()} disconnected: {reason}")
        for cb in list(self._lost_callbacks):
            try:
                cb(peer.name, reason)
            except Exception:
                log.exception("peer-lost callback failed")
        if not self._closed:
            log.info("%s lost: %s", peer.describe(), reason)

    # ---- notifications -----------------------------------------------------------------------------------------
    def on_notification(self, cb: Callable[[Notification], None]) -> None:
        """Call `cb` (on the agent's event loop) for every notification. With a callback registered, notifications
        that no `wait_notification` claims are not queued."""
        self._notes.add_callback(cb)

    def on_peer_lost(self, cb: Callable[[str, str], None]) -> None:
        """Call `cb(peer_name, reason)` when a peer disconnects (so held blocks can be released)."""
        self._lost_callbacks.append(cb)

    def deliver_threadsafe(self, peer: str, xfer_id: int, op: str, payload: bytes, key: str | None = None,
                           error: str | None = None) -> None:
        """Hand over a notification received in band by a transport (any thread)."""
        n = Notification(peer, xfer_id, op, payload, time.perf_counter_ns(), error, key)
        if self._loop is not None and not self._closed:
            self._loop.call_soon_threadsafe(self._deliver, n)

    def _deliver(self, n: Notification) -> None:
        """Every notification passes here: with access control, only those whose key a live grant admits from
        their sender; a failed transfer is reported once (the receiver's own refusal and the initiator's report
        of the same transfer are one failure)."""
        if self.config.access_control and not self.grants.allows_notify(n.key, n.peer, n.op):
            log.warning("dropped a %s notification %d from peer %s: no live grant of key %r admits it",
                        "failure" if n.error is not None else n.op, n.xfer_id, n.peer, n.key)
            return
        if n.error is not None:
            k = (n.peer, n.xfer_id)
            if k in self._failed_seen:
                return
            self._failed_seen[k] = None
            if len(self._failed_seen) > _FAILED_SEEN:
                self._failed_seen.popitem(last=False)
        mark(self.config.nvtx, f"kv.notification {n.op} {n.peer} #{n.xfer_id}")
        self._notes.deliver(n)

    def poll_notifications(self) -> list[Notification]:
        """Take every queued notification (non-blocking); check `.error` on each."""
        return self._notes.poll()

    async def wait_notification(self, peer: str | None = None, predicate: Callable[[Notification], bool] | None = None,
                                timeout: float | None = None) -> Notification:
        """The next notification (from `peer`, matching `predicate`); raises TransferTimeoutError after `timeout`
        seconds (default: the transfer timeout), PeerDisconnectedError if that peer goes away first, and
        KVTransferError if the matching transfer failed."""
        n = self._notes.take_queued(peer, predicate)
        if n is not None:
            return n
        if peer is not None and peer not in self._peers:
            raise PeerDisconnectedError(f"not connected to peer {peer!r}")
        return await self._notes.wait(peer, predicate, timeout if timeout is not None else self.config.transfer_timeout_s)

    # ---- transfers ---------------------------------------------------------------------------------------------
    async def write(self, peer: str, xfers: XferList, notif: bytes | dict[str, Any] | None = None, *,
                    key: str | None = None, timeout: float | None = None, transport: str | None = None,
                    wait_event: Any = None, coalesce: bool = True) -> XferResult:
        """Push local bytes into the peer's regions; the peer is notified (with `notif`) after they landed.

        `key` (the request id) names the peer's grant this transfer writes under; a peer that checks grants
        refuses a transfer without one (AccessDeniedError) and learns of the refusal as a failed notification.
        For CUDA memory the copy is ordered after `wait_event` (a torch.cuda.Event recorded after the producer's
        kernels) or, without one, after the work queued so far on the device's default stream; work on other
        streams must be synchronized by the caller (or passed as wait_event).
        """
        return await self._transfer("write", peer, xfers, notif, key, timeout, transport, wait_event, coalesce)

    async def read(self, peer: str, xfers: XferList, notif: bytes | dict[str, Any] | None = None, *,
                   key: str | None = None, timeout: float | None = None, transport: str | None = None,
                   wait_event: Any = None, coalesce: bool = True) -> XferResult:
        """Pull the peer's bytes into local regions (under the peer's "r" grant for `key`); the peer is notified
        (op 'read') once we are done reading."""
        return await self._transfer("read", peer, xfers, notif, key, timeout, transport, wait_event, coalesce)

    async def write_blocks(self, peer: str, src_ids: Any, dst_ids: Any, block_bytes: int, local_region: int,
                           remote_region: int | str, notif: bytes | dict[str, Any] | None = None, **kw: Any) -> XferResult:
        """Push whole KV blocks src_ids (ours) into dst_ids (the peer's); runs of consecutive ids are coalesced."""
        rr = self.peer(peer).region_id(remote_region) if isinstance(remote_region, str) else remote_region
        xl = block_xfers(src_ids, dst_ids, block_bytes, local_region, rr, coalesce=False)  # write() coalesces
        return await self.write(peer, xl, notif, **kw)

    async def read_blocks(self, peer: str, remote_ids: Any, local_ids: Any, block_bytes: int, local_region: int,
                          remote_region: int | str, notif: bytes | dict[str, Any] | None = None, **kw: Any) -> XferResult:
        """Pull the peer's blocks remote_ids into our local_ids."""
        rr = self.peer(peer).region_id(remote_region) if isinstance(remote_region, str) else remote_region
        xl = block_xfers(local_ids, remote_ids, block_bytes, local_region, rr, coalesce=False)  # read() coalesces
        return await self.read(peer, xl, notif, **kw)

    def pick_transport(self, peer: Peer, x: XferList, forced: str | None = None) -> Transport:
        local = [self.regions.get(r) for r in distinct(x.local_region)]
        remote = [peer.regions[r] for r in distinct(x.remote_region)]
        name = forced or self.config.transport
        if name != "auto":
            tr = self.transports.get(name)
            if tr is None:
                raise TransportUnavailableError(f"transport {name!r} is not available in this process "
                                                f"(available: {sorted(self.transports)})")
            why = tr.supports(peer, local, remote)
            if why:
                raise TransportUnavailableError(f"transport {name} cannot serve {peer.describe()}: {why}")
            return tr
        for name in _AUTO_ORDER:
            tr = self.transports.get(name)
            if tr is not None and tr.supports(peer, local, remote) is None:
                return tr
        raise TransportUnavailableError(f"no transport can serve {peer.describe()}")

    async def _transfer(self, op: str, peer_name: str, xfers: XferList, notif: Any, key: str | None,
                        timeout: float | None, transport: str | None, wait_event: Any, coalesce: bool) -> XferResult:
        t0 = time.perf_counter()
        p = self.peer(peer_name)
        if key is not None:
            check_key(key)
        x = xfers.coalesce() if coalesce else xfers
        validate(x, self.regions.sizes(), p.region_sizes(), op=op)
        if len(x) > self.config.max_descs_per_transfer:
            raise LimitExceededError(f"{len(x)} descriptors after coalescing exceed max_descs_per_transfer="
                                     f"{self.config.max_descs_per_transfer}")
        payload = encode_notif(notif)
        if payload is not None and len(payload) > self.config.max_notif_bytes:
            raise LimitExceededError(f"a {len(payload)} byte notification exceeds max_notif_bytes="
                                     f"{self.config.max_notif_bytes}")
        xid = next(self._ids)
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.transfer_timeout_s)
        delivered = False
        tname = "none"
        with nvtx_range(self.config.nvtx, f"kv.{op} {p.name} #{xid} {x.total_bytes}B"):
            if len(x):
                tr = self.pick_transport(p, x, transport)
                tname = tr.name
                try:
                    try:
                        delivered = await tr.transfer(op, p, x, payload, xid, deadline, wait_event, key)
                    except KVTransferError:
                        raise
                    except Exception as e:
                        raise KVTransferError(f"{op} {xid} to {p.describe()} via {tr.name} failed: "
                                              f"{type(e).__name__}: {e}") from e
                except KVTransferError as e:
                    # the receiver may wait for this transfer: tell it, best effort (it may know already)
                    if payload is not None or key is not None:
                        await self._report_failure(p, xid, op, payload or b"", key, str(e))
                    raise
            if payload is not None and not delivered:
                await p.send({"t": "notif", "x": xid, "op": op, "p": payload, "k": key})
        return XferResult(xid, p.name, op, tname, x.total_bytes, len(xfers), len(x), time.perf_counter() - t0)

    async def _report_failure(self, p: Peer, xid: int, op: str, payload: bytes, key: str | None, why: str) -> None:
        if not p.alive:
            return
        try:
            await asyncio.wait_for(p.send({"t": "failed", "x": xid, "op": op, "p": payload, "k": key,
                                           "why": why[:4000]}), 1.0)
        except (KVTransferError, asyncio.TimeoutError):
            pass

    async def notify(self, peer: str, payload: bytes | dict[str, Any], key: str | None = None) -> None:
        """A notification with no data (e.g. 'nothing to send, recompute'), for the peer's grant of `key`."""
        if key is not None:
            check_key(key)
        body = encode_notif(payload) or b""
        if len(body) > self.config.max_notif_bytes:
            raise LimitExceededError(f"a {len(body)} byte notification exceeds max_notif_bytes")
        await self.peer(peer).send({"t": "notif", "x": next(self._ids), "op": "notify", "p": body, "k": key})


def _my_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

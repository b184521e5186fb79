"""The transfer agent: one per process. Registers memory, connects to peers, moves descriptor lists, notifies.

Lifecycle: `register()` memory once (the KV pool is one tensor), `await start()` to listen on one port (control and
data connections share it), `await connect("host:port")` to handshake with a peer (region tables and transport
information are exchanged once; the control connection stays open), then `await write(...)` / `await read(...)`
as often as needed. The receiver learns that data landed through a notification (`on_notification` callback or
`await wait_notification(...)`), which is only sent after the bytes are in its memory.

Every wait is bounded (connect, transfer deadline, notification wait), a lost control connection marks the peer
dead at once and fails whoever waits on it, and registered regions stay valid whatever happens to a transfer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.kv.config import AgentConfig
from pdserve.kv.descs import XferList, block_xfers, distinct, validate
from pdserve.kv.errors import (
    KVTransferError,
    PeerDisconnectedError,
    PeerUnreachableError,
    TransportUnavailableError,
)
from pdserve.kv.listener import Listener
from pdserve.kv.metadata import make_metadata
from pdserve.kv.notify import Notification, Notifications, encode_notif
from pdserve.kv.peer import Peer
from pdserve.kv.regions import MemoryRegion, RegionTable, host_id
from pdserve.kv.transports import build_transports
from pdserve.kv.transports.base import Transport
from pdserve.kv.transports.tcp import split_address
from pdserve.kv.wire import PREAMBLE_CTRL, pack_ctrl, read_ctrl

log = logging.getLogger(__name__)


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
        self.config = config or AgentConfig(**overrides)
        self.name = self.config.name or f"{socket.gethostname()}-{__import__('os').getpid()}-{secrets.token_hex(3)}"
        self.host_id = host_id()
        self.regions = RegionTable()
        self.transports: dict[str, Transport] = build_transports(self)
        self._peers: dict[str, Peer] = {}
        self._ids = itertools.count(1)
        self._notes = Notifications(self.config.max_queued_notifications)
        self._lost_callbacks: list[Callable[[str, str], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listen: Listener | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._address = ""
        self._meta = make_metadata(self.config)

    # ---- memory ------------------------------------------------------------------------------------------------
    def register(self, obj: Any, name: str | None = None) -> int:
        """Register a torch tensor (CPU, pinned or CUDA), numpy array or bytearray; returns its region id."""
        reg = self.regions.add(obj, name)
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

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._address

    @property
    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    async def start(self) -> str:
        """Listen for peers; returns the address they should dial ("host:port")."""
        if self._loop is not None:
            return self._address
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        loop = self._loop
        self._listen = Listener(
            cfg.host, cfg.port, cfg.connect_timeout_s,
            on_control=lambda s: asyncio.run_coroutine_threadsafe(self._serve_ctrl(s), loop),
            on_data=lambda s, peer: self.transports["tcp"].serve(s, peer))  # type: ignore[attr-defined]
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
            self._listen.close()
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

    # ---- accepting -----------------------------------------------------------------------------------------------
    async def _serve_ctrl(self, s: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=s)
        try:
            hello = await asyncio.wait_for(read_ctrl(reader), self.config.connect_timeout_s)
            if hello.get("t") != "hello":
                raise ValueError(f"expected hello, got {hello.get('t')!r}")
            if hello.get("name") == self.name:
                writer.write(pack_ctrl({"t": "error", "msg": f"agent name {self.name!r} is taken (connected to self?)"}))
                writer.close()
                return
            peer = self._make_peer(hello, writer)
            writer.write(pack_ctrl(self._hello("hello_ok")))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, asyncio.TimeoutError) as e:
            log.warning("handshake from a peer failed: %s", e)
            writer.close()
            return
        await self._add_peer(peer)
        self._spawn(self._reader_loop(peer, reader))

    # ---- connecting --------------------------------------------------------------------------------------------
    def _extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for t in self.transports.values():
            extra.update(t.hello_extra())
        return extra

    def _hello(self, kind: str) -> dict[str, Any]:
        return {"t": kind, "name": self.name, "address": self._address, "host_id": self.host_id,
                "pid": __import__("os").getpid(), "transports": sorted(self.transports),
                "regions": self._describe_regions(), "extra": self._extra()}

    def _make_peer(self, hello: dict[str, Any], writer: asyncio.StreamWriter) -> Peer:
        p = Peer(name=str(hello["name"]), address=str(hello["address"]), host_id=str(hello["host_id"]),
                 pid=int(hello.get("pid", 0)), transports=list(hello.get("transports", [])), writer=writer,
                 hello=dict(hello.get("extra") or {}))
        p.set_regions(hello.get("regions", []))
        return p

    async def _add_peer(self, peer: Peer) -> None:
        old = self._peers.get(peer.name)
        self._peers[peer.name] = peer
        if old is not None and old is not peer:
            old.alive = False
            old.writer.close()
        for t in self.transports.values():
            try:
                await t.on_peer(peer)
            except Exception as e:  # a transport that cannot map this peer is simply not chosen for it
                log.warning("transport %s cannot serve %s: %s", t.name, peer.describe(), e)

    async def connect(self, target: str, timeout: float | None = None) -> str:
        """Handshake with the agent at `target` ("host:port", or a name when a metadata backend is configured);
        returns the peer's name. Connecting to an already connected address returns at once."""
        if self._loop is None:
            await self.start()
        timeout = timeout or self.config.connect_timeout_s
        address = await self._resolve(target, timeout)
        for p in self._peers.values():
            if p.address == address and p.alive:
                return p.name
        host, port = split_address(address)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            why = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e)
            raise PeerUnreachableError(f"cannot connect to KV agent at {address}: {why}") from e
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            writer.write(PREAMBLE_CTRL + pack_ctrl(self._hello("hello")))
            reply = await asyncio.wait_for(read_ctrl(reader), timeout)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, asyncio.TimeoutError) as e:
            writer.close()
            raise PeerUnreachableError(f"handshake with KV agent at {address} failed: {e!r}") from e
        if reply.get("t") != "hello_ok":
            writer.close()
            raise PeerUnreachableError(f"KV agent at {address} rejected the handshake: {reply.get('msg', reply.get('t'))}")
        peer = self._make_peer(reply, writer)
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
                msg = await read_ctrl(reader)
                t = msg["t"]
                if t == "notif":
                    self._deliver(Notification(peer.name, int(msg["x"]), str(msg["op"]), bytes(msg["p"]),
                                               time.perf_counter_ns()))
                elif t == "failed":
                    self._deliver(Notification(peer.name, int(msg["x"]), str(msg["op"]), bytes(msg["p"]),
                                               time.perf_counter_ns(), error=str(msg.get("why", "unknown"))))
                elif t == "regions":
                    peer.set_regions(msg["regions"])
                    peer.hello.update(msg.get("extra") or {})
                    for tr in self.transports.values():
                        try:
                            await tr.on_peer(peer)
                        except Exception as e:
                            log.warning("transport %s cannot serve %s: %s", tr.name, peer.describe(), e)
                elif t == "bye":
                    reason = "peer closed its agent"
                    break
        except asyncio.IncompleteReadError:
            reason = "connection closed by peer (process exited or crashed?)"
        except (ConnectionError, OSError, ValueError) as e:
            reason = f"control connection failed: {e}"
        except asyncio.CancelledError:
            reason = "local agent closed"
            raise
        finally:
            self._peer_lost(peer, reason)

    def _peer_lost(self, peer: Peer, reason: str) -> None:
        if self._peers.get(peer.name) is not peer:
            return
        del self._peers[peer.name]
        peer.alive = False
        peer.lost_reason = reason
        peer.writer.close()
        for t in self.transports.values():
            t.on_peer_lost(peer)
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

    def deliver_threadsafe(self, peer: str, xfer_id: int, op: str, payload: bytes) -> None:
        n = Notification(peer, xfer_id, op, payload, time.perf_counter_ns())
        if self._loop is not None and not self._closed:
            self._loop.call_soon_threadsafe(self._deliver, n)

    def _deliver(self, n: Notification) -> None:
        self._notes.deliver(n)

    def poll_notifications(self) -> list[Notification]:
        """Take every queued notification (non-blocking); check `.error` on each."""
        return self._notes.poll()

    async def wait_notification(self, peer: str | None = None, predicate: Callable[[Notification], bool] | None = None,
                                timeout: float | None = None) -> Notification:
        """The next notification (from `peer`, matching `predicate`); raises TransferTimeoutError after `timeout`
        seconds (default: the transfer timeout), PeerDisconnectedError if that peer goes away first, and
        KVTransferError if the initiator reports that the matching transfer failed."""
        n = self._notes.take_queued(peer, predicate)
        if n is not None:
            return n
        if peer is not None and peer not in self._peers:
            raise PeerDisconnectedError(f"not connected to peer {peer!r}")
        return await self._notes.wait(peer, predicate, timeout if timeout is not None else self.config.transfer_timeout_s)

    # ---- transfers ---------------------------------------------------------------------------------------------
    async def write(self, peer: str, xfers: XferList, notif: bytes | dict[str, Any] | None = None, *,
                    timeout: float | None = None, transport: str | None = None, wait_event: Any = None,
                    coalesce: bool = True) -> XferResult:
        """Push local bytes into the peer's regions; the peer is notified (with `notif`) after they landed.

        For CUDA memory the copy is ordered after `wait_event` (a torch.cuda.Event recorded after the producer's
        kernels) or, without one, after the work queued so far on the device's default stream; work on other
        streams must be synchronized by the caller (or passed as wait_event).
        """
        return await self._transfer("write", peer, xfers, notif, timeout, transport, wait_event, coalesce)

    async def read(self, peer: str, xfers: XferList, notif: bytes | dict[str, Any] | None = None, *,
                   timeout: float | None = None, transport: str | None = None, wait_event: Any = None,
                   coalesce: bool = True) -> XferResult:
        """Pull the peer's bytes into local regions; the peer is notified (op 'read') once we are done reading."""
        return await self._transfer("read", peer, xfers, notif, timeout, transport, wait_event, coalesce)

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
        for name in ("cuda_ipc", "nixl", "tcp"):
            tr = self.transports.get(name)
            if tr is not None and tr.supports(peer, local, remote) is None:
                return tr
        raise TransportUnavailableError(f"no transport can serve {peer.describe()}")

    async def _transfer(self, op: str, peer_name: str, xfers: XferList, notif: Any, timeout: float | None,
                        transport: str | None, wait_event: Any, coalesce: bool) -> XferResult:
        t0 = time.perf_counter()
        p = self.peer(peer_name)
        x = xfers.coalesce() if coalesce else xfers
        validate(x, self.regions.sizes(), p.region_sizes(), op=op)
        payload = encode_notif(notif)
        xid = next(self._ids)
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.transfer_timeout_s)
        delivered = False
        tname = "none"
        if len(x):
            tr = self.pick_transport(p, x, transport)
            tname = tr.name
            try:
                try:
                    delivered = await tr.transfer(op, p, x, payload, xid, deadline, wait_event)
                except KVTransferError:
                    raise
                except Exception as e:
                    raise KVTransferError(f"{op} {xid} to {p.describe()} via {tr.name} failed: "
                                          f"{type(e).__name__}: {e}") from e
            except KVTransferError as e:
                if payload is not None:  # the receiver may be waiting for this payload: tell it, best effort
                    await self._report_failure(p, xid, op, payload, str(e))
                raise
        if payload is not None and not delivered:
            await p.send({"t": "notif", "x": xid, "op": op, "p": payload})
        return XferResult(xid, p.name, op, tname, x.total_bytes, len(xfers), len(x), time.perf_counter() - t0)

    async def _report_failure(self, p: Peer, xid: int, op: str, payload: bytes, why: str) -> None:
        if not p.alive:
            return
        try:
            await asyncio.wait_for(p.send({"t": "failed", "x": xid, "op": op, "p": payload, "why": why}), 1.0)
        except (KVTransferError, asyncio.TimeoutError):
            pass

    async def notify(self, peer: str, payload: bytes | dict[str, Any]) -> None:
        """A notification with no data (e.g. 'nothing to send, recompute')."""
        await self.peer(peer).send({"t": "notif", "x": next(self._ids), "op": "notify", "p": encode_notif(payload)})


def _my_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

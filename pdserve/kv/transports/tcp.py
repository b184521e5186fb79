"""tcp: any memory, any hosts. Striped over parallel data connections; GPU memory staged through pinned buffers.

Why blocking sockets in threads on the sending side: a KV transfer is a few large runs of bytes, and the fastest
path is `sendall(memoryview of the region)` straight from registered memory and `recv_into(memoryview of the
region)` straight into it (no intermediate copies, no per-chunk Python objects); both release the GIL, so stripes
on several connections proceed in parallel. Asyncio only awaits the stripes. The receiving side
(tcp_server.TcpServer) keeps idle connections in asyncio and copies in a bounded thread pool.

Data connections are authenticated like control connections (pdserve.kv.auth: same handshake, role "data") and
pooled per peer, so the handshake is paid once per connection, not per transfer.

Data-channel protocol (initiator -> server, one request at a time per connection):
    REQ header + its MAC, body (descriptors of the server's memory, the request key, notification bytes) + its MAC,
    then for a WRITE the data (followed by its MAC when payload MACs are on);
    the server answers RESP (status, message) + MAC after the data landed (WRITE) or before sending the data (READ).
Payload bytes are not MACed by default (AgentConfig.mac_payload): see the README's security section for why.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.kv.auth import Session
from pdserve.kv.descs import XferList
from pdserve.kv.errors import (
    AccessDeniedError,
    InvalidDescriptorError,
    KVTransferError,
    LimitExceededError,
    PeerAuthenticationError,
    PeerDisconnectedError,
    TransferTimeoutError,
)
from pdserve.kv.handshake import initiate_blocking
from pdserve.kv.transports.base import Transport
from pdserve.kv.transports.tcp_io import RegionIO, recv_into_by, split_address, tune_socket
from pdserve.kv.transports.tcp_server import FLAG_NOTIF, FLAG_PAYLOAD_MAC, TcpServer
from pdserve.kv.wire import (
    BODY_LABEL,
    MAGIC,
    MAX_RESP_MSG,
    OP_READ,
    OP_WRITE,
    PREAMBLE_DATA,
    REQ,
    REQ_LABEL,
    RESP,
    RESP_LABEL,
    ST_DENIED,
    ST_LIMIT,
    ST_PAYLOAD_MAC,
    TAG,
    ProtocolError,
    pack_descs,
    recv_exact,
)

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

log = logging.getLogger(__name__)

__all__ = ["TcpTransport", "split_address", "tune_socket"]


class RemoteRejected(KVTransferError):
    """The peer refused a request (bad descriptor, no grant, a limit); the connection is still in sync."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


_REJECTED = {ST_DENIED: AccessDeniedError, ST_LIMIT: LimitExceededError, ST_PAYLOAD_MAC: KVTransferError}


@dataclass
class _Conn:
    sock: socket.socket
    session: Session
    last_used: float


class _XferConns:
    """The data connections one transfer is using, so a deadline or a failed stripe can abort the others."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.aborted = False

    def add(self, s: socket.socket) -> None:
        with self.lock:
            if self.aborted:
                raise KVTransferError("transfer aborted")
            self.conns.add(s)

    def discard(self, s: socket.socket) -> None:
        with self.lock:
            self.conns.discard(s)

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            for s in self.conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self._pools: dict[str, list[_Conn]] = {}
        self._pool_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max(8, cfg.tcp_connections * 4), thread_name_prefix="kv-tcp")
        self.io = RegionIO(cfg.tcp_staging_bytes)
        self.server = TcpServer(ctx, self.io)
        self._closed = False

    async def serve(self, sock: socket.socket, session: Session) -> None:
        """Serve an authenticated incoming data connection (called by the agent's listener)."""
        await self.server.serve(sock, session)

    # ---- client side -------------------------------------------------------------------------------------------
    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        return None

    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None, key: str | None = None) -> bool:
        cfg = self.ctx.config
        if wait_event is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, wait_event.synchronize)
        stripes = xfers.split_bytes(cfg.tcp_connections, min_bytes=cfg.tcp_stripe_min_bytes)
        conns = _XferConns()
        loop = asyncio.get_running_loop()
        opcode = OP_WRITE if op == "write" else OP_READ
        flags = FLAG_NOTIF if (notif is not None and op == "write") else 0
        payload = notif if flags else b""
        key_b = key.encode() if key is not None else b""
        futs = [loop.run_in_executor(self._executor, self._run_stripe, opcode, flags, peer, s, i, len(stripes),
                                     payload if i == 0 else b"", xfer_id, conns, deadline, key_b)
                for i, s in enumerate(stripes)]
        done, pending = await asyncio.wait(futs, timeout=max(0.0, deadline - time.monotonic()),
                                           return_when=asyncio.FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if pending or failed:
            conns.abort()  # unblock the other stripes now; wait for them so no thread still touches our memory
            if pending:
                await asyncio.wait(pending, timeout=cfg.io_timeout_s + 1.0)
            for f in futs:  # retrieve every stripe's outcome (no "exception never retrieved" noise)
                if f.done() and not f.cancelled():
                    f.exception()
            if failed:
                err = failed[0].exception()
                if isinstance(err, RemoteRejected):
                    cls = _REJECTED.get(err.status, InvalidDescriptorError)
                    raise cls(f"{op} {xfer_id} rejected by {peer.describe()}: {err}") from err
                if isinstance(err, KVTransferError):
                    raise err
                if isinstance(err, TimeoutError):
                    raise TransferTimeoutError(f"{op} {xfer_id} to {peer.describe()} stalled: no progress on a data "
                                               f"connection within {cfg.io_timeout_s:g} s or past the deadline") from err
                raise PeerDisconnectedError(f"{op} {xfer_id} to {peer.describe()} failed over tcp: "
                                            f"{type(err).__name__}: {err}") from err
            raise TransferTimeoutError(f"{op} {xfer_id} to {peer.describe()} did not finish within its deadline "
                                       f"({xfers.total_bytes} bytes over {len(stripes)} connection(s))")
        return bool(flags)

    def _connect(self, peer: Peer, deadline: float) -> _Conn:
        cfg = self.ctx.config
        host, port = split_address(peer.address)
        try:
            s = socket.create_connection((host, port), timeout=cfg.connect_timeout_s)
        except OSError as e:
            raise PeerDisconnectedError(f"cannot open a data connection to {peer.describe()}: {e}") from e
        try:
            # each handshake step is one socket operation: a stalled peer fails it within the io timeout
            s.settimeout(max(0.001, min(cfg.io_timeout_s, deadline - time.monotonic())))
            tune_socket(s, cfg.tcp_socket_buffer)
            s.sendall(PREAMBLE_DATA)
            session = initiate_blocking(s, cfg.secret, "data", self.ctx.name, peer.address)
        except PeerAuthenticationError:
            s.close()
            raise
        except TimeoutError as e:
            s.close()
            raise TransferTimeoutError(f"data connection handshake with {peer.describe()} stalled: {e}") from e
        except (OSError, ProtocolError) as e:
            s.close()
            raise PeerDisconnectedError(f"data connection handshake with {peer.describe()} failed: {e}") from e
        if session.peer != peer.name:
            s.close()
            raise PeerAuthenticationError(f"KV peer authentication failed: the agent at {peer.address} is "
                                          f"{session.peer!r}, not {peer.name!r}")
        s.settimeout(cfg.io_timeout_s)
        return _Conn(s, session, time.monotonic())

    def _acquire(self, peer: Peer, deadline: float) -> _Conn:
        """A pooled connection to `peer`, or a new one. Pooled connections idle for more than half the server's
        idle timeout are closed rather than reused (the server may be closing them right now)."""
        stale: list[_Conn] = []
        got = None
        horizon = time.monotonic() - self.ctx.config.data_idle_timeout_s / 2
        with self._pool_lock:
            pool = self._pools.get(peer.name)
            while pool:
                c = pool.pop()
                if c.last_used >= horizon:
                    got = c
                    break
                stale.append(c)
        for c in stale:
            c.sock.close()
        return got if got is not None else self._connect(peer, deadline)

    def _release(self, peer: Peer, c: _Conn) -> None:
        c.last_used = time.monotonic()
        with self._pool_lock:
            if peer.alive and not self._closed:
                self._pools.setdefault(peer.name, []).append(c)
                return
        c.sock.close()

    def _run_stripe(self, opcode: int, flags: int, peer: Peer, x: XferList, stripe: int, nstripes: int,
                    notif: bytes, xfer_id: int, conns: _XferConns, deadline: float, key: bytes) -> None:
        c = self._acquire(peer, deadline)
        s, session = c.sock, c.session
        ok = False
        try:
            conns.add(s)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"transfer {xfer_id} to {peer.describe()} passed its deadline")
            s.settimeout(min(self.ctx.config.io_timeout_s, remaining))
            macd = self.ctx.config.mac_payload
            fl = flags | (FLAG_PAYLOAD_MAC if macd else 0)
            hdr = REQ.pack(MAGIC, opcode, fl, stripe, nstripes, len(key), len(x), len(notif), xfer_id, x.total_bytes)
            body = pack_descs(x.remote_region, x.remote_offset, x.length) + key + notif
            s.sendall(hdr + session.seal(REQ_LABEL, hdr) + body + session.seal(BODY_LABEL, body))
            regions = self.ctx.regions
            runs = zip(x.local_region.tolist(), x.local_offset.tolist(), x.length.tolist())
            if opcode == OP_WRITE:
                mac = session.stream_mac(sending=True) if macd else None
                for r, o, n in runs:
                    self.io.send(s, regions.get(r), o, n, mac)
                if mac is not None:
                    s.sendall(mac.digest())
                self._read_resp(s, session, xfer_id, deadline)
            else:
                self._read_resp(s, session, xfer_id, deadline)
                mac = session.stream_mac(sending=False) if macd else None
                for r, o, n in runs:
                    self.io.recv(s, regions.get(r), o, n, deadline, mac)
                if mac is not None and not hmac.compare_digest(recv_exact(s, TAG), mac.digest()):
                    raise ProtocolError(f"the data of read {xfer_id} from {peer.describe()} failed its "
                                        "authentication check; do not use it")
            ok = True
        except RemoteRejected as e:
            # the server answered (a refused WRITE's data drained): the connection is still in step, except after
            # a limit, where the server could not read past the request and closes it
            ok = e.status != ST_LIMIT
            raise
        finally:
            conns.discard(s)
            if ok:
                self._release(peer, c)
            else:
                s.close()

    @staticmethod
    def _read_resp(s: socket.socket, session: Session, xfer_id: int, deadline: float) -> None:
        head = bytearray(RESP.size)
        recv_into_by(s, memoryview(head), deadline)
        magic, status, mlen, xid = RESP.unpack(head)
        if magic != MAGIC or mlen > MAX_RESP_MSG:
            raise ProtocolError("malformed response on a data connection")
        rest = bytearray(mlen + TAG)
        recv_into_by(s, memoryview(rest), deadline)
        msg = bytes(rest[:mlen])
        if not session.open(bytes(rest[mlen:]), RESP_LABEL, bytes(head), msg):
            raise ProtocolError("a response failed its authentication check")
        if xid != xfer_id:
            raise ProtocolError(f"response for transfer {xid}, expected {xfer_id}")
        if status != 0:
            raise RemoteRejected(status, msg.decode(errors="replace"))

    def on_peer_lost(self, peer: Peer) -> None:
        with self._pool_lock:
            pool = self._pools.pop(peer.name, [])
        for c in pool:
            c.sock.close()
        self.server.forget_peer(peer.name)

    async def close(self) -> None:
        self._closed = True
        with self._pool_lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            for c in pool:
                c.sock.close()
        self.server.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

"""The receiving side of the tcp transport: one coroutine per authenticated data connection.

An idle connection costs a socket and a suspended coroutine, no thread. Each request is read and checked on the
event loop first: the fixed-size header and its MAC, the announced sizes against this agent's limits (before
anything is allocated), the body (descriptors, key, notification) and its MAC, the descriptors against the region
table, and, with access control, against the live grants of the request's key for this peer. Only then does a
thread of a bounded pool move bytes between the socket and memory. A refused request is answered with a reason
(its WRITE data drained), so the connection stays usable; a request that breaks the protocol (bad MAC, sizes over
the limits) closes the connection. Nothing here raises beyond its own connection.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pdserve.kv.descs import validate_side
from pdserve.kv.errors import InvalidDescriptorError, RegionError
from pdserve.kv.nvtx import nvtx_range
from pdserve.kv.transports.tcp_io import RegionIO, drain, recv_into_by, tune_socket
from pdserve.kv.wire import (
    BODY_LABEL,
    DESC,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_RESP_MSG,
    OP_READ,
    OP_WRITE,
    REQ,
    REQ_LABEL,
    RESP,
    RESP_LABEL,
    ST_DENIED,
    ST_INVALID,
    ST_LIMIT,
    ST_OK,
    ST_PAYLOAD_MAC,
    TAG,
    ProtocolError,
    unpack_descs,
)

if TYPE_CHECKING:
    from pdserve.kv.auth import Session
    from pdserve.kv.context import TransportContext

log = logging.getLogger(__name__)
FLAG_NOTIF = 1
FLAG_PAYLOAD_MAC = 2
DRAIN_LIMIT = 1 << 32  # a refused WRITE larger than this closes the connection instead of being drained
MAX_PENDING_STRIPES = 65536  # transfers with stripes outstanding, over all peers


INLINE_BYTES = 256 << 10  # requests up to this size (host memory) are served on the event loop


async def recv_into_soon(sock: socket.socket, view: memoryview, timeout: float) -> None:
    """Fill `view` from a non-blocking socket: straight away as far as the socket buffer holds, then waiting on the
    loop (bounded by `timeout`) for the rest."""
    got, n = 0, view.nbytes
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except (BlockingIOError, InterruptedError):
            break
        if k == 0:
            raise ConnectionResetError(f"connection closed by peer after {got} of {n} bytes")
        got += k
    if got < n:
        await asyncio.wait_for(sock_recv_into_all(sock, view[got:]), timeout)


async def send_soon(sock: socket.socket, data: bytes | memoryview, timeout: float) -> None:
    """Send on a non-blocking socket: straight away as far as the socket buffer takes it, then on the loop."""
    view = memoryview(data)
    sent = 0
    while sent < view.nbytes:
        try:
            sent += sock.send(view[sent:])
        except (BlockingIOError, InterruptedError):
            break
    if sent < view.nbytes:
        await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(sock, view[sent:]), timeout)


async def sock_recv_into_all(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    got, n = 0, view.nbytes
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError(f"connection closed by peer after {got} of {n} bytes")
        got += k


def pack_resp(session: Session, status: int, xfer_id: int, msg: str) -> bytes:
    m = msg.encode()[:MAX_RESP_MSG]
    head = RESP.pack(MAGIC, status, len(m), xfer_id)
    return head + m + session.seal(RESP_LABEL, head, m)


class _Request:
    """One parsed, authenticated request."""

    __slots__ = ("op", "flags", "stripe", "nstripes", "xfer_id", "total", "key", "notif", "regs", "offset", "length")

    def __init__(self, op: int, flags: int, stripe: int, nstripes: int, xfer_id: int, total: int) -> None:
        self.op, self.flags, self.stripe, self.nstripes, self.xfer_id, self.total = op, flags, stripe, nstripes, xfer_id, total
        self.key: str | None = None
        self.notif = b""
        self.regs: list[Any] = []
        self.offset: list[int] = []
        self.length: list[int] = []

    @property
    def opname(self) -> str:
        return "write" if self.op == OP_WRITE else "read"


class TcpServer:
    def __init__(self, ctx: TransportContext, io: RegionIO) -> None:
        self.ctx = ctx
        self.io = io
        self._pool = ThreadPoolExecutor(max_workers=ctx.config.tcp_server_threads, thread_name_prefix="kv-tcp-srv")
        self._landed: collections.OrderedDict[tuple[str, int], list[Any]] = collections.OrderedDict()
        self._landed_lock = threading.Lock()  # stripes of one transfer land in different pool threads
        self._served: set[socket.socket] = set()
        self.closed = False

    async def serve(self, sock: socket.socket, session: Session) -> None:
        """Serve one authenticated data connection until it closes, idles out or breaks the protocol."""
        cfg = self.ctx.config
        tune_socket(sock, cfg.tcp_socket_buffer)
        self._served.add(sock)
        loop = asyncio.get_running_loop()
        head = bytearray(REQ.size + TAG)
        idle = [False]

        def idled_out() -> None:  # a timer instead of wait_for: no task per request on the hot path
            idle[0] = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        try:
            while not self.closed:
                timer = loop.call_later(cfg.data_idle_timeout_s, idled_out)
                try:
                    await sock_recv_into_all(sock, memoryview(head))
                except (ConnectionError, OSError):
                    if idle[0]:
                        log.debug("closed the data connection of %s: idle for %g s", session.peer,
                                  cfg.data_idle_timeout_s)
                    return  # the peer closed (between requests, or dying mid-header), or it idled out
                finally:
                    timer.cancel()
                await self._serve_one(sock, session, bytes(head))
        finally:
            self._served.discard(sock)

    async def _serve_one(self, sock: socket.socket, session: Session, head: bytes) -> None:
        cfg = self.ctx.config
        peer = session.peer
        loop = asyncio.get_running_loop()
        header = head[:REQ.size]
        if not session.open(head[REQ.size:], REQ_LABEL, header):
            raise ProtocolError(f"a request header from {peer} failed its authentication check")
        magic, op, flags, stripe, nstripes, klen, ndescs, nlen, xid, total = REQ.unpack(header)
        if magic != MAGIC or op not in (OP_WRITE, OP_READ) or nstripes == 0 or stripe >= nstripes:
            raise ProtocolError(f"malformed request header from {peer}")
        limit = ""
        if ndescs > cfg.max_descs_per_transfer:
            limit = f"{ndescs} descriptors exceed this agent's limit of {cfg.max_descs_per_transfer} per transfer"
        elif nlen > cfg.max_notif_bytes:
            limit = f"a {nlen} byte notification exceeds this agent's limit of {cfg.max_notif_bytes}"
        elif klen > MAX_KEY_BYTES:
            limit = f"a {klen} byte key exceeds {MAX_KEY_BYTES} bytes"
        if limit:  # refused before reading (or allocating) the body; it cannot be skipped, so the connection ends
            await loop.sock_sendall(sock, pack_resp(session, ST_LIMIT, xid, limit))
            raise ProtocolError(f"request {xid} from {peer}: {limit}")
        nd = ndescs * DESC.itemsize
        raw = bytearray(nd + klen + nlen + TAG)
        await recv_into_soon(sock, memoryview(raw), cfg.io_timeout_s)
        body = memoryview(raw)[:-TAG]
        if not session.open(bytes(raw[-TAG:]), BODY_LABEL, body):
            raise ProtocolError(f"a request body from {peer} failed its authentication check")
        req = _Request(op, flags, stripe, nstripes, xid, total)
        status, err = self._check(req, peer, body, nd, klen)
        with nvtx_range(cfg.nvtx, f"kv.serve {req.opname} {peer} #{xid}"):
            if status == ST_OK and not flags & FLAG_PAYLOAD_MAC and total <= INLINE_BYTES and all(
                    r.host_view is not None for r in req.regs):
                await self._move_inline(sock, session, req)
            else:
                await self._in_pool(sock, self._move, sock, session, req, status, err)

    async def _move_inline(self, sock: socket.socket, session: Session, req: _Request) -> None:
        """A small request between the socket and host memory, on the loop: a thread hop would cost more than the
        copy (the bytes are usually in the socket buffer already)."""
        io_timeout = self.ctx.config.io_timeout_s
        key = req.key
        if key is not None:
            self.ctx.grants.begin(key)
        try:
            if req.op == OP_WRITE:
                for reg, o, n in zip(req.regs, req.offset, req.length):
                    await recv_into_soon(sock, reg.host_view[o:o + n], io_timeout)
                await send_soon(sock, pack_resp(session, ST_OK, req.xfer_id, ""), io_timeout)
                if req.flags & FLAG_NOTIF:
                    self._landed_stripe(session.peer, req)
            else:
                await send_soon(sock, pack_resp(session, ST_OK, req.xfer_id, ""), io_timeout)
                for reg, o, n in zip(req.regs, req.offset, req.length):
                    await send_soon(sock, reg.host_view[o:o + n], io_timeout)
        finally:
            if key is not None:
                self.ctx.grants.end(key)

    def _check(self, req: _Request, peer: str, body: memoryview, nd: int, klen: int) -> tuple[int, str]:
        """(status, reason) for the request; fills req's key, notification and copy plan when it may proceed."""
        cfg = self.ctx.config
        try:
            req.notif = bytes(body[nd + klen:])
            try:
                req.key = bytes(body[nd:nd + klen]).decode() if klen else None
            except UnicodeDecodeError:
                raise InvalidDescriptorError("the request key is not UTF-8") from None
            region, offset, length = unpack_descs(body[:nd])
            validate_side(region, offset, length, self.ctx.regions.sizes(),
                          side="destination" if req.op == OP_WRITE else "source", check_overlap=req.op == OP_WRITE)
            if int(length.sum()) != req.total:
                raise InvalidDescriptorError(f"descriptor lengths sum to {int(length.sum())}, header says {req.total}")
            if cfg.mac_payload and req.op == OP_WRITE and not req.flags & FLAG_PAYLOAD_MAC:
                raise InvalidDescriptorError("this agent requires payload MACs (mac_payload) and the request has none")
            if cfg.access_control:
                v = self.ctx.grants.check(req.key, peer, req.opname, region, offset, length)
                if not v.ok:
                    return ST_DENIED, v.why
            req.regs = [self.ctx.regions.get(int(r)) for r in region.tolist()]
            req.offset, req.length = offset.tolist(), length.tolist()
        except (InvalidDescriptorError, RegionError) as e:
            return ST_INVALID, str(e)
        return ST_OK, ""

    async def _in_pool(self, sock: socket.socket, fn: Any, *args: Any) -> None:
        """Run a blocking copy in the bounded pool; the socket is blocking (with the io timeout) only meanwhile."""
        timeout = self.ctx.config.io_timeout_s

        def run() -> None:
            sock.settimeout(timeout)
            try:
                fn(*args)
            finally:
                sock.setblocking(False)

        await asyncio.get_running_loop().run_in_executor(self._pool, run)

    def _move(self, sock: socket.socket, session: Session, req: _Request, status: int, err: str) -> None:
        """The blocking part of a request (in a pool thread): data in or out, the response, the notification."""
        cfg = self.ctx.config
        peer = session.peer
        deadline = time.monotonic() + cfg.transfer_timeout_s
        macd = bool(req.flags & FLAG_PAYLOAD_MAC)
        if req.op == OP_WRITE and status != ST_OK:
            if req.total > DRAIN_LIMIT:
                sock.sendall(pack_resp(session, status, req.xfer_id, err))
                raise ProtocolError(f"refused oversized write {req.xfer_id} from {peer}: {err}")
            drain(sock, req.total + (TAG if macd else 0), deadline)
            if macd:
                session.stream_mac(sending=False)  # keep the counters in step with the sender
        if status != ST_OK:
            sock.sendall(pack_resp(session, status, req.xfer_id, err))
            self._refused(peer, req, err)
            return
        key = req.key
        if key is not None:
            self.ctx.grants.begin(key)
        try:
            if req.op == OP_WRITE:
                mac = session.stream_mac(sending=False) if macd else None
                for reg, o, n in zip(req.regs, req.offset, req.length):
                    self.io.recv(sock, reg, o, n, deadline, mac)
                if mac is not None:
                    tag = bytearray(TAG)
                    recv_into_by(sock, memoryview(tag), deadline)
                    if not hmac.compare_digest(bytes(tag), mac.digest()):
                        why = "the data failed its authentication check (altered in transit?); do not use it"
                        sock.sendall(pack_resp(session, ST_PAYLOAD_MAC, req.xfer_id, why))
                        self._refused(peer, req, why)
                        return
                sock.sendall(pack_resp(session, ST_OK, req.xfer_id, ""))
                if req.flags & FLAG_NOTIF:
                    self._landed_stripe(peer, req)
            else:
                sock.sendall(pack_resp(session, ST_OK, req.xfer_id, ""))
                mac = session.stream_mac(sending=True) if macd else None
                for reg, o, n in zip(req.regs, req.offset, req.length):
                    self.io.send(sock, reg, o, n, mac)
                if mac is not None:
                    sock.sendall(mac.digest())
        finally:
            if key is not None:
                self.ctx.grants.end(key)

    def _refused(self, peer: str, req: _Request, why: str) -> None:
        log.warning("refused %s %d from peer %s (key %r): %s", req.opname, req.xfer_id, peer, req.key, why)
        if req.key is not None:  # the agent delivers it only if the key's grant admits this peer
            self.ctx.deliver(peer, req.xfer_id, req.opname, req.notif if req.stripe == 0 else b"", req.key, why)

    def _landed_stripe(self, peer: str, req: _Request) -> None:
        """Count landed stripes; when all of a transfer's stripes are in memory, deliver its notification."""
        k = (peer, req.xfer_id)
        with self._landed_lock:
            ent = self._landed.get(k)
            if ent is None:
                if len(self._landed) >= MAX_PENDING_STRIPES:
                    old, _ = self._landed.popitem(last=False)
                    log.warning("dropped the stripe count of transfer %d from %s (too many transfers in flight)",
                                old[1], old[0])
                ent = self._landed[k] = [0, b"", req.key, req.nstripes]
            ent[0] += 1
            if req.stripe == 0:
                ent[1] = req.notif
            if ent[0] < ent[3]:
                return
            del self._landed[k]
        self.ctx.deliver(peer, req.xfer_id, "write", ent[1], ent[2], None)

    def forget_peer(self, peer: str) -> None:
        with self._landed_lock:
            for k in [k for k in self._landed if k[0] == peer]:
                self._landed.pop(k, None)

    def close(self) -> None:
        self.closed = True
        for s in list(self._served):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)

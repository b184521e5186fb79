"""tcp: any memory, any hosts. Striped over parallel data connections; GPU memory staged through pinned buffers.

Why blocking sockets in threads and not asyncio streams: a KV transfer is a few large runs of bytes, and the fastest
path is `sendall(memoryview of the region)` straight from registered memory and `recv_into(memoryview of the
region)` straight into it (no intermediate copies, no per-chunk Python objects); both release the GIL, so stripes
on several connections proceed in parallel. Asyncio only awaits the stripes.

Data-channel protocol (initiator -> server, one request at a time per connection):
    REQ header, descriptors of the server's memory, notification bytes, then for a WRITE the data;
    the server answers RESP (status, message) after the data landed (WRITE) or before sending data (READ).
The server validates descriptors against its own region table before touching memory; a bad WRITE is drained and
answered with an error, so the connection stays usable and nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pdserve.kv.descs import XferList, validate_side
from pdserve.kv.errors import InvalidDescriptorError, KVTransferError, PeerDisconnectedError, TransferTimeoutError
from pdserve.kv.transports.base import Transport
from pdserve.kv.wire import (
    DESC,
    MAGIC,
    MAX_DESCS,
    OP_READ,
    OP_WRITE,
    PREAMBLE_DATA,
    REQ,
    RESP,
    pack_descs,
    recv_exact,
    recv_into_exact,
    unpack_descs,
)

if TYPE_CHECKING:
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

log = logging.getLogger(__name__)
FLAG_NOTIF = 1
_DRAIN_LIMIT = 1 << 32  # a bad WRITE larger than this closes the connection instead of being drained


class RemoteRejected(KVTransferError):
    """The peer refused a request (bad descriptor, unknown region); the connection is still in sync."""


def tune_socket(sock: socket.socket, bufsize: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
        except OSError:
            pass


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class _Staging(threading.local):
    """Per-thread pinned buffers for GPU memory (allocated on first use, reused for every chunk)."""

    buf: Any = None
    views: Any = None
    stream: Any = None
    events: Any = None
    device: int = -1


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

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        cfg = agent.config
        self._pools: dict[str, list[socket.socket]] = {}
        self._pool_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max(8, cfg.tcp_connections * 4), thread_name_prefix="kv-tcp")
        self._staging = _Staging()
        self._landed: dict[tuple[str, int], list[Any]] = {}
        self._landed_lock = threading.Lock()
        self._served: set[socket.socket] = set()
        self._closed = False

    # ---- client side -------------------------------------------------------------------------------------------
    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        return None

    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None) -> bool:
        cfg = self.agent.config
        if wait_event is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, wait_event.synchronize)
        stripes = xfers.split_bytes(cfg.tcp_connections, min_bytes=cfg.tcp_stripe_min_bytes)
        conns = _XferConns()
        loop = asyncio.get_running_loop()
        opcode = OP_WRITE if op == "write" else OP_READ
        flags = FLAG_NOTIF if (notif is not None and op == "write") else 0
        payload = notif if flags else b""
        futs = [loop.run_in_executor(self._executor, self._run_stripe, opcode, flags, peer, s, i, len(stripes),
                                     payload if i == 0 else b"", xfer_id, conns, deadline)
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
                    raise InvalidDescriptorError(f"{op} {xfer_id} rejected by {peer.describe()}: {err}") from err
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

    def _connect(self, peer: Peer) -> socket.socket:
        cfg = self.agent.config
        host, port = split_address(peer.address)
        try:
            s = socket.create_connection((host, port), timeout=cfg.connect_timeout_s)
        except OSError as e:
            raise PeerDisconnectedError(f"cannot open a data connection to {peer.describe()}: {e}") from e
        tune_socket(s, cfg.tcp_socket_buffer)
        s.settimeout(cfg.io_timeout_s)
        name = self.agent.name.encode()
        s.sendall(PREAMBLE_DATA + struct.pack("<H", len(name)) + name)
        return s

    def _acquire(self, peer: Peer) -> socket.socket:
        with self._pool_lock:
            pool = self._pools.get(peer.name)
            if pool:
                return pool.pop()
        return self._connect(peer)

    def _release(self, peer: Peer, s: socket.socket) -> None:
        with self._pool_lock:
            if peer.alive and not self._closed:
                self._pools.setdefault(peer.name, []).append(s)
                return
        s.close()

    def _run_stripe(self, opcode: int, flags: int, peer: Peer, x: XferList, stripe: int, nstripes: int,
                    notif: bytes, xfer_id: int, conns: _XferConns, deadline: float) -> None:
        s = self._acquire(peer)
        ok = False
        try:
            conns.add(s)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"transfer {xfer_id} to {peer.describe()} passed its deadline")
            s.settimeout(min(self.agent.config.io_timeout_s, remaining))
            hdr = REQ.pack(MAGIC, opcode, flags, stripe, nstripes, len(x), len(notif), xfer_id, x.total_bytes)
            s.sendall(hdr + pack_descs(x.remote_region, x.remote_offset, x.length) + notif)
            regions = self.agent.regions
            if opcode == OP_WRITE:
                for r, o, n in zip(x.local_region.tolist(), x.local_offset.tolist(), x.length.tolist()):
                    self._send_region(s, regions.get(r), o, n)
                self._read_resp(s, xfer_id)
            else:
                self._read_resp(s, xfer_id)
                for r, o, n in zip(x.local_region.tolist(), x.local_offset.tolist(), x.length.tolist()):
                    self._recv_region(s, regions.get(r), o, n)
            ok = True
        except RemoteRejected:
            ok = True  # the server drained the request: the connection is still in sync
            raise
        finally:
            conns.discard(s)
            if ok:
                self._release(peer, s)
            else:
                s.close()

    @staticmethod
    def _read_resp(s: socket.socket, xfer_id: int) -> None:
        magic, status, mlen, xid = RESP.unpack(recv_exact(s, RESP.size))
        msg = recv_exact(s, mlen).decode(errors="replace") if mlen else ""
        if magic != MAGIC or xid != xfer_id:
            raise ConnectionError(f"protocol error on data connection (response for {xid}, expected {xfer_id})")
        if status != 0:
            raise RemoteRejected(msg)

    # ---- moving bytes between a socket and a region ------------------------------------------------------------
    def _stage(self, device: int) -> tuple[list[Any], list[memoryview], Any, list[Any]]:
        """This thread's two pinned half-buffers, their byte views, a copy stream on `device` and two events.

        Two buffers so the GPU copy of one chunk overlaps the socket transfer of the other."""
        st = self._staging
        if st.buf is None or st.device != device:
            import torch

            half = max(1 << 20, self.agent.config.tcp_staging_bytes // 2)
            st.buf = [torch.empty(half, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            st.views = [memoryview(b.numpy()) for b in st.buf]
            st.stream = torch.cuda.Stream(device=device)
            st.events = [torch.cuda.Event(), torch.cuda.Event()]
            st.device = device
        return st.buf, st.views, st.stream, st.events

    def _send_region(self, s: socket.socket, reg: MemoryRegion, off: int, n: int) -> None:
        if reg.host_view is not None:
            s.sendall(reg.host_view[off:off + n])
            return
        import torch

        bufs, views, stream, events = self._stage(reg.device)
        step = bufs[0].numel()
        chunks = [(p, min(step, n - p)) for p in range(0, n, step)]
        src = reg.tensor
        with torch.cuda.device(reg.device), torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.default_stream(reg.device))  # after the producer's queued work

            def fetch(k: int) -> None:
                p, c = chunks[k]
                bufs[k % 2][:c].copy_(src[off + p:off + p + c], non_blocking=True)  # device -> pinned
                events[k % 2].record(stream)

            fetch(0)
            for k, (_, c) in enumerate(chunks):
                if k + 1 < len(chunks):
                    fetch(k + 1)  # its buffer was sent (synchronously) in the previous iteration
                events[k % 2].synchronize()
                s.sendall(views[k % 2][:c])

    def _recv_region(self, s: socket.socket, reg: MemoryRegion, off: int, n: int) -> None:
        if reg.host_view is not None:
            recv_into_exact(s, reg.host_view[off:off + n])
            return
        import torch

        bufs, views, stream, events = self._stage(reg.device)
        step = bufs[0].numel()
        dst = reg.tensor
        with torch.cuda.device(reg.device), torch.cuda.stream(stream):
            for k, p in enumerate(range(0, n, step)):
                c = min(step, n - p)
                if k >= 2:
                    events[k % 2].synchronize()  # the copy that last read this buffer is done
                recv_into_exact(s, views[k % 2][:c])
                dst[off + p:off + p + c].copy_(bufs[k % 2][:c], non_blocking=True)  # pinned -> device
                events[k % 2].record(stream)
            stream.synchronize()  # landed before the response (and the notification) goes out

    # ---- server side -------------------------------------------------------------------------------------------
    def serve(self, s: socket.socket, peer_name: str) -> None:
        """Serve one data connection until EOF (runs in its own thread)."""
        cfg = self.agent.config
        tune_socket(s, cfg.tcp_socket_buffer)
        with self._landed_lock:
            self._served.add(s)
        try:
            while not self._closed:
                hdr = self._wait_header(s)
                if hdr is None:
                    return
                self._serve_one(s, peer_name, hdr)
        except (OSError, ConnectionError, KVTransferError) as e:
            if not self._closed:
                log.warning("data connection from %s failed: %s", peer_name, e)
        finally:
            with self._landed_lock:
                self._served.discard(s)
            s.close()

    def _wait_header(self, s: socket.socket) -> bytes | None:
        """Next request header, waiting idle as long as needed; None on a clean close between requests."""
        buf = bytearray(REQ.size)
        view = memoryview(buf)
        got = 0
        s.settimeout(self.agent.config.io_timeout_s)
        while got < REQ.size:
            try:
                k = s.recv_into(view[got:], REQ.size - got)
            except TimeoutError:
                if got == 0 and not self._closed:
                    continue  # idle pooled connection
                raise
            if k == 0:
                if got == 0:
                    return None
                raise ConnectionResetError("connection closed inside a request header")
            got += k
        return bytes(buf)

    def _serve_one(self, s: socket.socket, peer_name: str, hdr: bytes) -> None:
        magic, op, flags, stripe, nstripes, ndescs, notif_len, xfer_id, total = REQ.unpack(hdr)
        if magic != MAGIC or op not in (OP_WRITE, OP_READ) or ndescs > MAX_DESCS or notif_len > (64 << 20):
            raise ConnectionError(f"protocol error from {peer_name}: bad request header")
        region, offset, length = unpack_descs(recv_exact(s, ndescs * DESC.itemsize))
        notif = recv_exact(s, notif_len) if notif_len else b""
        err = ""
        try:
            validate_side(region, offset, length, self.agent.regions.sizes(), side="destination" if op == OP_WRITE
                          else "source", check_overlap=op == OP_WRITE)
            if int(length.sum()) != total:
                raise InvalidDescriptorError(f"descriptor lengths sum to {int(length.sum())}, header says {total}")
            regs = [self.agent.regions.get(int(r)) for r in region.tolist()]
        except (InvalidDescriptorError, KVTransferError) as e:
            err = str(e)
        if op == OP_WRITE:
            if err:
                if total > _DRAIN_LIMIT:
                    raise ConnectionError(f"rejected oversized write from {peer_name}: {err}")
                self._drain(s, total)
                self._respond(s, 1, xfer_id, err)
                log.warning("rejected write %d from %s: %s", xfer_id, peer_name, err)
                return
            for reg, o, n in zip(regs, offset.tolist(), length.tolist()):
                self._recv_region(s, reg, o, n)
            self._respond(s, 0, xfer_id, "")
            if flags & FLAG_NOTIF:
                self._landed_stripe(peer_name, xfer_id, nstripes, notif if stripe == 0 else None)
        else:
            if err:
                self._respond(s, 1, xfer_id, err)
                return
            self._respond(s, 0, xfer_id, "")
            for reg, o, n in zip(regs, offset.tolist(), length.tolist()):
                self._send_region(s, reg, o, n)

    @staticmethod
    def _respond(s: socket.socket, status: int, xfer_id: int, msg: str) -> None:
        m = msg.encode()
        s.sendall(RESP.pack(MAGIC, status, len(m), xfer_id) + m)

    @staticmethod
    def _drain(s: socket.socket, n: int) -> None:
        buf = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n > 0:
            k = s.recv_into(buf, min(n, buf.nbytes))
            if k == 0:
                raise ConnectionResetError("connection closed while draining a rejected write")
            n -= k

    def _landed_stripe(self, peer_name: str, xfer_id: int, nstripes: int, notif: bytes | None) -> None:
        """Count landed stripes; when all of a transfer's stripes are in memory, deliver its notification."""
        key = (peer_name, xfer_id)
        with self._landed_lock:
            ent = self._landed.setdefault(key, [0, b""])
            ent[0] += 1
            if notif is not None:
                ent[1] = notif
            if ent[0] < nstripes:
                return
            del self._landed[key]
        self.agent.deliver_threadsafe(peer_name, xfer_id, "write", ent[1])

    def on_peer_lost(self, peer: Peer) -> None:
        with self._pool_lock:
            pool = self._pools.pop(peer.name, [])
        for s in pool:
            s.close()
        with self._landed_lock:
            for k in [k for k in self._landed if k[0] == peer.name]:
                del self._landed[k]

    async def close(self) -> None:
        self._closed = True
        with self._pool_lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            for s in pool:
                s.close()
        with self._landed_lock:
            served = list(self._served)
        for s in served:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)


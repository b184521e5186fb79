"""Tools of the KV port attack tests: raw clients that speak (parts of) the protocol, a recording TCP proxy, and
what /proc says about a victim process's threads and memory."""

from __future__ import annotations

import asyncio
import socket
import time

from pdserve.kv.auth import Session
from pdserve.kv.handshake import initiate_blocking
from pdserve.kv.transports.tcp_io import split_address
from pdserve.kv.wire import DESC, MAGIC, OP_WRITE, PREAMBLE_DATA, REQ, REQ_LABEL


def proc_status(pid: int) -> dict[str, int]:
    """Threads, VmRSS and VmHWM (peak RSS, kB) of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Threads", "VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    return out


def raw(address: str, timeout: float = 5.0) -> socket.socket:
    host, port = split_address(address)
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(timeout)
    return s


def read_all(s: socket.socket, timeout: float = 3.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `timeout` passes with the connection open (False)."""
    s.settimeout(timeout)
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return got, False
        except (ConnectionResetError, BrokenPipeError):
            return got, True
        if not chunk:
            return got, True
        got += chunk
    return got, False


def data_client(address: str, secret: bytes | None, name: str) -> tuple[socket.socket, Session]:
    """An authenticated data connection, as a peer holding the secret opens it (the real handshake)."""
    s = raw(address)
    s.sendall(PREAMBLE_DATA)
    return s, initiate_blocking(s, secret, "data", name, address)


def write_header(session: Session, ndescs: int, total: int, xfer_id: int = 1, key: bytes = b"") -> bytes:
    """A correctly authenticated WRITE request header announcing `ndescs` descriptors (body not included)."""
    hdr = REQ.pack(MAGIC, OP_WRITE, 0, 0, 1, len(key), ndescs, 0, xfer_id, total)
    return hdr + session.seal(REQ_LABEL, hdr)


DESC_BYTES = DESC.itemsize


class RecordingProxy:
    """A TCP forwarder that records what each client sends (per connection, in order) and can corrupt one byte of
    the client->server stream of the connection it is told to."""

    def __init__(self, target: str) -> None:
        self.target = split_address(target)
        self.sessions: list[bytearray] = []
        self.corrupt: tuple[int, int] | None = None  # (connection index, byte offset) to flip
        self._server: asyncio.AbstractServer | None = None
        self.address = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        idx = len(self.sessions)
        rec = bytearray()
        self.sessions.append(rec)
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, record: bool) -> None:
            try:
                while True:
                    chunk = await r.read(65536)
                    if not chunk:
                        break
                    if record:
                        start = len(rec)
                        rec.extend(chunk)
                        if self.corrupt is not None and self.corrupt[0] == idx:
                            off = self.corrupt[1] - start
                            if 0 <= off < len(chunk):
                                chunk = chunk[:off] + bytes([chunk[off] ^ 0xFF]) + chunk[off + 1:]
                    w.write(chunk)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(cr, sw, True), pump(sr, cw, False))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

"""Handing a file descriptor (a CUDA VMM allocation's handle) to an authenticated peer on the same host: a Unix
socket and SCM_RIGHTS, opened only with a one-time token that travelled on the authenticated control connection.

    exporter: server.offer(peer, make_fd) -> (socket name, token)   (sent to the peer on the control connection)
    importer: fetch_fd(socket name, token, timeout) -> fd

The socket is in Linux's abstract namespace under a random name: no file to clean up, reachable by processes of the
same network namespace. Whoever connects must send a live token within the handshake timeout, or is closed having
received nothing; a token works once and expires after `ttl_s`. So only the agent that authenticated on the control
connection (and asked for this offer there) receives the descriptor. The server runs on the agent's event loop: an
idle or slow client holds a socket and a suspended task, never a thread.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
TOKEN_BYTES = 32
MAX_OFFERS = 256


@dataclass
class _Offer:
    peer: str
    make_fd: Callable[[], int]
    header: bytes
    expires: float


class FdServer:
    def __init__(self, ttl_s: float = 10.0, io_timeout_s: float = 5.0) -> None:
        self.ttl_s, self.io_timeout_s = ttl_s, io_timeout_s
        self.name = "\0pdserve-kv-fd-" + secrets.token_hex(12)
        self._offers: dict[bytes, _Offer] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self.served = 0
        self.refused = 0

    def _start(self) -> None:
        if self._sock is not None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.name)
        s.listen(16)
        s.setblocking(False)
        self._sock = s
        self._task = asyncio.get_running_loop().create_task(self._accept())

    def offer(self, peer: str, make_fd: Callable[[], int], header: bytes = b"") -> tuple[str, bytes]:
        """Let the holder of the returned token fetch one descriptor (made by `make_fd` when fetched) once, within
        the ttl. Call on the event loop; the socket is opened on first use."""
        self._start()
        now = time.monotonic()
        for t in [t for t, o in self._offers.items() if o.expires < now]:
            del self._offers[t]
        if len(self._offers) >= MAX_OFFERS:
            raise RuntimeError(f"{MAX_OFFERS} descriptor offers are pending; refusing more")
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[token] = _Offer(peer, make_fd, header, now + self.ttl_s)
        return self.name, token

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                log.warning("fd share: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    def _take(self, token: bytes) -> _Offer | None:
        now = time.monotonic()
        for t in list(self._offers):  # constant-time comparisons: no timing hint about live tokens
            if hmac.compare_digest(t, token):
                o = self._offers.pop(t)
                return o if o.expires >= now else None
        return None

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        try:
            token = b""
            end = loop.time() + self.io_timeout_s
            while len(token) < TOKEN_BYTES:
                chunk = await asyncio.wait_for(loop.sock_recv(conn, TOKEN_BYTES - len(token)),
                                               max(0.0, end - loop.time()))
                if not chunk:
                    break
                token += chunk
            offer = self._take(token) if len(token) == TOKEN_BYTES else None
            if offer is None:
                self.refused += 1
                log.warning("fd share: refused a connection without a live token")
                return
            fd = offer.make_fd()
            try:
                conn.setblocking(True)
                conn.settimeout(self.io_timeout_s)
                socket.send_fds(conn, [b"F" + offer.header], [fd])
            finally:
                os.close(fd)
            self.served += 1
        except asyncio.TimeoutError:
            self.refused += 1
            log.warning("fd share: closed a connection that sent no token within %g s", self.io_timeout_s)
        except OSError as e:
            log.warning("fd share: a connection ended: %s", e)
        except Exception:  # an exporter failure ends this connection only
            log.exception("fd share: exporting a descriptor failed")
        finally:
            conn.close()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._conns):
            t.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._offers.clear()


def fetch_fd(name: str, token: bytes, timeout: float) -> tuple[int, bytes]:
    """Connect to an FdServer, prove the token, receive (descriptor, header). Blocking (run it in a thread)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(name)
        s.sendall(token)
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    finally:
        s.close()
    if not msg.startswith(b"F") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the peer's descriptor server refused the token (expired, used, or wrong)")
    return fds[0], msg[1:]

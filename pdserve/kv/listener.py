"""The agent's one listening port: an asyncio accept loop that authenticates every connection before anything else.

Why one port for control and data: a peer needs one address per agent (what the handshake, etcd and the router
exchange). Each connection starts with a preamble naming its role, then (control, with TLS configured) a TLS
handshake, then the secret handshake of pdserve.kv.auth. Only an authenticated connection reaches the agent.

Bounds (AgentConfig): connections in total, authenticated connections per peer, unauthenticated connections in
flight (beyond which the oldest is dropped, so an idle flood cannot lock legitimate peers out), and the handshake
timeout. Everything runs on the event loop: an idle or handshaking connection holds a socket and a suspended task,
never a thread. Whatever happens inside one connection's task ends there (logged with the peer's identity).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.kv import handshake
from pdserve.kv.auth import Session
from pdserve.kv.config import AgentConfig
from pdserve.kv.errors import KVTransferError, PeerAuthenticationError
from pdserve.kv.tls import server_context
from pdserve.kv.wire import PREAMBLE_BYTES, PREAMBLE_CTRL, PREAMBLE_DATA, ProtocolError

log = logging.getLogger(__name__)

OnControl = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Session], Awaitable[None]]
OnData = Callable[[socket.socket, Session], Awaitable[None]]


@dataclass
class _Conn:
    cid: int
    sock: socket.socket
    addr: str
    task: asyncio.Task | None = None
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    peer: str | None = None  # set once authenticated (and counted against the peer's limit)


class _Throttle:
    """At most `n` log lines per `window` seconds for one kind of event, with a count of the ones left out."""

    def __init__(self, n: int = 10, window: float = 10.0) -> None:
        self.n, self.window, self.t0, self.used, self.dropped = n, window, 0.0, 0, 0

    def __call__(self, level: int, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.t0 > self.window:
            if self.dropped:
                log.warning("KV port: %d more refused or failed incoming connections were not logged", self.dropped)
            self.t0, self.used, self.dropped = now, 0, 0
        if self.used < self.n:
            self.used += 1
            log.log(level, fmt, *args)
        else:
            self.dropped += 1


class Listener:
    def __init__(self, cfg: AgentConfig, name: str, on_control: OnControl, on_data: OnData) -> None:
        self.cfg, self.name = cfg, name
        self.on_control, self.on_data = on_control, on_data
        self._ssl = server_context(cfg)
        self._conns: dict[int, _Conn] = {}
        self._pending: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count()
        self._accept_task: asyncio.Task | None = None
        self._log = _Throttle()
        self.closed = False
        host, port = cfg.host, cfg.port
        ls = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            ls.bind((host, port))
        except OSError as e:
            ls.close()
            raise KVTransferError(f"KV agent cannot listen on {host}:{port}: {e}") from e
        ls.listen(256)
        ls.setblocking(False)
        self.sock = ls
        self.port: int = ls.getsockname()[1]

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    def stats(self) -> dict[str, Any]:
        """Open incoming connections: in total, still handshaking, and authenticated ones per peer."""
        return {"connections": len(self._conns), "pending": len(self._pending), "per_peer": dict(self._per_peer)}

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed:
            try:
                s, addr = await loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # e.g. out of file descriptors: back off instead of spinning
                if self.closed:
                    return
                self._log(logging.WARNING, "KV port: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            self._admit(s, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))

    def _admit(self, s: socket.socket, addr: str) -> None:
        cfg = self.cfg
        if len(self._conns) >= cfg.max_connections and self._pending:
            self._evict_oldest_pending("the connection limit")
        if len(self._pending) >= cfg.max_pending_handshakes:
            self._evict_oldest_pending("the limit of unauthenticated connections")
        if len(self._conns) >= cfg.max_connections:
            self._log(logging.WARNING, "KV port: refused a connection from %s: %d connections open (max_connections)",
                      addr, len(self._conns))
            s.close()
            return
        s.setblocking(False)
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        conn = _Conn(next(self._ids), s, addr)
        self._conns[conn.cid] = conn
        self._pending[conn.cid] = conn
        conn.task = asyncio.get_running_loop().create_task(self._serve(conn))

    def _evict_oldest_pending(self, why: str) -> None:
        _, old = self._pending.popitem(last=False)
        self._log(logging.WARNING, "KV port: dropped the unauthenticated connection from %s to stay within %s",
                  old.addr, why)
        if old.task is not None:
            old.task.cancel()
        self._drop(old)  # now: a task cancelled before it ever ran would not reach its own clean-up

    def _admitter(self, conn: _Conn) -> Callable[[str, str], str | None]:
        def admit(peer: str, role: str) -> str | None:
            if peer == self.name:
                return f"agent name {peer!r} is taken (connected to itself?)"
            if self._per_peer[peer] >= self.cfg.max_connections_per_peer:
                return f"too many connections from this peer (max_connections_per_peer={self.cfg.max_connections_per_peer})"
            self._per_peer[peer] += 1
            conn.peer = peer
            return None

        return admit

    async def _handshake(self, conn: _Conn) -> tuple[str, Session]:
        s = conn.sock
        pre = await handshake.sock_recv_exact(s, PREAMBLE_BYTES)
        if pre == PREAMBLE_DATA:
            recv, send = handshake.sock_channel(s)
            return "data", await handshake.accept(recv, send, self.cfg.secret, self.name, self._admitter(conn))
        if pre != PREAMBLE_CTRL:
            raise ProtocolError("not a pdserve KV connection (unknown preamble)")
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=s, ssl=self._ssl)
        conn.writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        recv, send = handshake.stream_channel(reader, conn.writer)
        conn.reader = reader
        return "ctrl", await handshake.accept(recv, send, self.cfg.secret, self.name, self._admitter(conn))

    async def _serve(self, conn: _Conn) -> None:
        try:
            try:
                role, session = await asyncio.wait_for(self._handshake(conn), self.cfg.handshake_timeout_s)
            except asyncio.TimeoutError:
                self._log(logging.INFO, "KV port: closed the connection from %s: no authentication within %g s",
                          conn.addr, self.cfg.handshake_timeout_s)
                return
            self._pending.pop(conn.cid, None)
            if role == "data":
                await self.on_data(conn.sock, session)
            else:
                assert conn.reader is not None and conn.writer is not None
                await self.on_control(conn.reader, conn.writer, session)
        except asyncio.CancelledError:
            pass  # evicted, or the agent is closing
        except PeerAuthenticationError as e:
            self._log(logging.WARNING, "KV port: refused the connection from %s: %s", conn.addr, e)
        except (ProtocolError, ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            self._log(logging.WARNING, "KV port: connection from %s (%s) ended: %s: %s", conn.addr,
                      f"peer {conn.peer}" if conn.peer else "unauthenticated", type(e).__name__, e)
        except Exception:  # a bug in a handler: end this connection, never the agent
            log.exception("KV port: the connection from %s (%s) failed", conn.addr, conn.peer or "unauthenticated")
        finally:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        """Forget and close a connection (idempotent)."""
        self._conns.pop(conn.cid, None)
        self._pending.pop(conn.cid, None)
        if conn.peer is not None:
            self._per_peer[conn.peer] -= 1
            if self._per_peer[conn.peer] <= 0:
                del self._per_peer[conn.peer]
            conn.peer = None
        if conn.writer is not None:
            conn.writer.close()
        else:
            try:  # wakes a copy thread still blocked on it (close alone would not, and the fd could be reused)
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()

    async def close(self) -> None:
        self.closed = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        conns = list(self._conns.values())
        tasks = [c.task for c in conns if c.task is not None]
        for t in tasks:
            t.cancel()
        for c in conns:
            self._drop(c)
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self.sock.close()

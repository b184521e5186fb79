"""The agent's one listening port: an accept thread that routes each connection by its preamble.

Why one port for control and data: a peer needs one address per agent (what the handshake, etcd and the router
exchange). Data connections are served right in their own thread (blocking socket I/O releases the GIL); control
connections are handed to the event loop.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from pdserve.kv.errors import KVTransferError
from pdserve.kv.wire import PREAMBLE_CTRL, PREAMBLE_DATA, recv_exact

log = logging.getLogger(__name__)


class Listener:
    def __init__(self, host: str, port: int, preamble_timeout: float, on_control: Callable[[socket.socket], None],
                 on_data: Callable[[socket.socket, str], None]) -> None:
        self.preamble_timeout = preamble_timeout
        self.on_control, self.on_data = on_control, on_data
        self.closed = False
        ls = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            ls.bind((host, port))
        except OSError as e:
            ls.close()
            raise KVTransferError(f"KV agent cannot listen on {host}:{port}: {e}") from e
        ls.listen(256)
        ls.settimeout(1.0)
        self.sock = ls
        self.port = ls.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"kv-accept-{self.port}", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                s, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.closed:
                    return
                continue
            threading.Thread(target=self._route, args=(s,), daemon=True, name="kv-conn").start()

    def _route(self, s: socket.socket) -> None:
        try:
            s.settimeout(self.preamble_timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pre = recv_exact(s, len(PREAMBLE_CTRL))
            if pre == PREAMBLE_DATA:
                (n,) = struct.unpack("<H", recv_exact(s, 2))
                self.on_data(s, recv_exact(s, n).decode())
                return
            if pre != PREAMBLE_CTRL or self.closed:
                s.close()
                return
            s.settimeout(None)
            s.setblocking(False)
            self.on_control(s)
        except (OSError, ConnectionError) as e:
            log.debug("dropped an incoming connection: %s", e)
            s.close()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

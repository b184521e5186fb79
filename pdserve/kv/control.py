"""Opening a control connection: dial, preamble, TLS (when configured), the secret handshake, then the exchange of
agent descriptions (address, host, transports, region table with each transport's export information), which only
authenticated peers ever see. Both directions of the exchange are authenticated frames (pdserve.kv.peer).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from pdserve.kv import frames, handshake
from pdserve.kv.auth import Session
from pdserve.kv.config import AgentConfig
from pdserve.kv.errors import PeerAuthenticationError, PeerUnreachableError
from pdserve.kv.peer import read_frame, seal_frame
from pdserve.kv.tls import client_context
from pdserve.kv.wire import PREAMBLE_CTRL, ProtocolError


async def _dial(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"cannot resolve {host}")
    family, kind, proto, _, sockaddr = infos[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(s, sockaddr)
        await loop.sock_sendall(s, PREAMBLE_CTRL)
    except BaseException:
        s.close()
        raise
    return s


async def open_control(cfg: AgentConfig, name: str, host: str, port: int, address: str,
                       hello: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Session, frames.Hello]:
    """Dial `address` and return the authenticated control connection and the peer's description. The caller
    bounds the whole call with its connect timeout. Raises PeerAuthenticationError for a failed handshake,
    PeerUnreachableError for anything else that went wrong."""
    try:
        s = await _dial(host, port)
    except OSError as e:
        raise PeerUnreachableError(f"cannot connect to KV agent at {address}: {e}") from e
    ctx = client_context(cfg)
    try:
        reader, writer = await asyncio.open_connection(
            sock=s, ssl=ctx, server_hostname=(host if cfg.tls_check_hostname else "") if ctx is not None else None)
    except (OSError, ConnectionError) as e:
        s.close()
        raise PeerUnreachableError(f"cannot set up the control connection to KV agent at {address}: {e}") from e
    try:
        recv, send = handshake.stream_channel(reader, writer)
        session = await handshake.initiate(recv, send, cfg.secret, "ctrl", name, address)
        writer.write(seal_frame(session, hello))
        await writer.drain()
        reply = await read_frame(reader, session, cfg.max_frame_bytes)
        return reader, writer, session, frames.hello(reply, "hello_ok")
    except PeerAuthenticationError:
        writer.close()
        raise
    except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError, frames.FrameError) as e:
        writer.close()
        raise PeerUnreachableError(f"handshake with KV agent at {address} failed: {type(e).__name__}: {e} (is it a "
                                   "pdserve KV agent of this version?)") from e


async def accept_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Session,
                       cfg: AgentConfig, hello_ok: dict[str, Any]) -> frames.Hello:
    """The listening side, after the handshake: the peer's description, then ours (bounded by the connect
    timeout as a whole)."""

    async def exchange() -> frames.Hello:
        info = frames.hello(await read_frame(reader, session, cfg.max_frame_bytes), "hello")
        writer.write(seal_frame(session, hello_ok))
        await writer.drain()
        return info

    return await asyncio.wait_for(exchange(), cfg.connect_timeout_s)

"""Running the handshake of pdserve.kv.auth over a connection: asyncio (listener, control client) or blocking
sockets (the tcp transport's data-connection threads). The callers bound the whole exchange with a timeout.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.kv.auth import Initiator, Responder, Session
from pdserve.kv.errors import PeerAuthenticationError
from pdserve.kv.wire import HANDSHAKE_LEN_BYTES, decode, handshake_len, pack_handshake, recv_exact

Recv = Callable[[int], Awaitable[bytes]]
Send = Callable[[bytes], Awaitable[None]]


async def sock_recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes from a non-blocking socket on the running loop (never more: the rest stays in the kernel)."""
    loop = asyncio.get_running_loop()
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def sock_channel(sock: socket.socket) -> tuple[Recv, Send]:
    loop = asyncio.get_running_loop()

    async def recv(n: int) -> bytes:
        return await sock_recv_exact(sock, n)

    async def send(b: bytes) -> None:
        await loop.sock_sendall(sock, b)

    return recv, send


def stream_channel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Recv, Send]:
    async def send(b: bytes) -> None:
        writer.write(b)
        await writer.drain()

    return reader.readexactly, send


async def _read(recv: Recv) -> Any:
    n = handshake_len(await recv(HANDSHAKE_LEN_BYTES))
    return decode(await recv(n))


async def accept(recv: Recv, send: Send, secret: bytes | None, name: str,
                 admit: Callable[[str, str], str | None] | None = None) -> Session:
    """The responder's side. Raises PeerAuthenticationError (after sending the peer a bare reject) when the peer
    does not prove the secret, or when `admit(peer_name, role)` returns a reason to turn an authenticated peer away.
    """
    r = Responder(secret, name)
    await send(pack_handshake(r.on_hello(await _read(recv))))
    try:
        accept_msg = r.on_proof(await _read(recv))
    except PeerAuthenticationError:
        await send(pack_handshake(Responder.reject()))
        raise
    why = admit(r.peer, r.role) if admit is not None else None
    if why:
        await send(pack_handshake(Responder.reject(why)))
        raise PeerAuthenticationError(f"turned away authenticated peer {r.peer!r}: {why}")
    await send(pack_handshake(accept_msg))
    return r.on_finish(await _read(recv))


async def initiate(recv: Recv, send: Send, secret: bytes | None, role: str, name: str, address: str) -> Session:
    """The initiator's side: PeerAuthenticationError when the peer refuses our proof or fails to prove its own;
    connection errors (a peer that closes or dies mid-handshake) propagate as they are."""
    i = Initiator(secret, role, name, address)
    await send(pack_handshake(i.hello()))
    await send(pack_handshake(i.on_challenge(await _read(recv))))
    fin = i.on_accept(await _read(recv))
    await send(pack_handshake(fin))
    assert i.session is not None
    return i.session


def initiate_blocking(sock: socket.socket, secret: bytes | None, role: str, name: str, address: str) -> Session:
    """The initiator's side on a blocking socket (whose timeout bounds each step)."""
    i = Initiator(secret, role, name, address)

    def read() -> Any:
        return decode(recv_exact(sock, handshake_len(recv_exact(sock, HANDSHAKE_LEN_BYTES))))

    sock.sendall(pack_handshake(i.hello()))
    sock.sendall(pack_handshake(i.on_challenge(read())))
    fin = i.on_accept(read())
    sock.sendall(pack_handshake(fin))
    assert i.session is not None
    return i.session

"""Wire formats: msgpack control frames, and the fixed binary headers of the tcp data channel.

Control and data travel on separate connections to the same port: the control connection (asyncio) carries the
handshake, region-table updates and notifications and stays open for the agent's life, so a notification costs one
small write and no handshake; data connections (blocking sockets in threads, so large sends and receives release
the GIL and run in parallel) carry only headers and raw bytes.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack
import numpy as np

PREAMBLE_CTRL = b"PDKVCTL1"
PREAMBLE_DATA = b"PDKVDAT1"
MAX_CTRL_FRAME = 256 << 20

_LEN = struct.Struct("<I")


def pack_ctrl(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def read_ctrl(reader: asyncio.StreamReader) -> dict[str, Any]:
    """Next control frame; raises asyncio.IncompleteReadError on EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_CTRL_FRAME:
        raise ValueError(f"control frame of {n} bytes exceeds the {MAX_CTRL_FRAME} byte limit")
    msg = msgpack.unpackb(await reader.readexactly(n), raw=False)
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError("malformed control frame")
    return msg


# Data channel. Request: header, ndescs descriptors of the server-side memory, notification bytes, then (WRITE) data.
OP_WRITE, OP_READ = 1, 2
REQ = struct.Struct("<4sBBHHIIQQ")  # magic, op, flags, stripe, nstripes, ndescs, notif_len, xfer_id, total_bytes
RESP = struct.Struct("<4sBxxxIQ")  # magic, status (0 ok), msg_len, xfer_id
MAGIC = b"PDKV"
DESC = np.dtype([("region", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_DESCS = 1 << 22


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError on EOF (the peer died or closed mid-message)."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError(f"connection closed by peer after {got} of {n} bytes")
        got += k


def pack_descs(region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> bytes:
    a = np.zeros(region.size, dtype=DESC)
    a["region"], a["offset"], a["length"] = region, offset, length
    return a.tobytes()


def unpack_descs(raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.frombuffer(raw, dtype=DESC)
    return a["region"].astype(np.int64), a["offset"].astype(np.int64), a["length"].astype(np.int64)

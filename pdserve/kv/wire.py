"""Wire formats: handshake frames, authenticated control frames, and the binary headers of the tcp data channel.

Control and data travel on separate connections to the same port, each starting with an 8-byte preamble and the
handshake of pdserve.kv.auth. The control connection (asyncio) then carries region-table updates and notifications
and stays open for the agent's life; data connections carry request headers and raw bytes.

Sizes are checked before anything is allocated: a handshake frame is at most MAX_HANDSHAKE_FRAME bytes, a control
frame at most the receiver's `max_frame_bytes`, a data request's descriptor count at most its
`max_descs_per_transfer` (checked on the authenticated fixed-size header, before the descriptors are read).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import numpy as np

from pdserve.kv.errors import InvalidDescriptorError

PREAMBLE_CTRL = b"PDKVCTL2"
PREAMBLE_DATA = b"PDKVDAT2"
PREAMBLE_BYTES = 8
MAX_HANDSHAKE_FRAME = 1024

_HS_LEN = struct.Struct("<H")
_CTRL_LEN = struct.Struct("<I")
TAG = 32


class ProtocolError(ConnectionError):
    """The peer broke the protocol (bad size, bad MAC, undecodable frame): the connection is closed."""


def decode(body: bytes | memoryview) -> Any:
    """msgpack, any failure (bad bytes, too deep) as ProtocolError."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on hostile input
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


# ---- handshake frames (before authentication): u16 length, msgpack ----
def pack_handshake(msg: dict[str, Any]) -> bytes:
    body = encode(msg)
    if len(body) > MAX_HANDSHAKE_FRAME:
        raise ValueError("handshake frame too large")
    return _HS_LEN.pack(len(body)) + body


def handshake_len(prefix: bytes) -> int:
    (n,) = _HS_LEN.unpack(prefix)
    if n > MAX_HANDSHAKE_FRAME:
        raise ProtocolError(f"handshake frame of {n} bytes (limit {MAX_HANDSHAKE_FRAME})")
    return n


HANDSHAKE_LEN_BYTES = _HS_LEN.size


# ---- control frames (after authentication): u32 length, msgpack body, HMAC tag ----
CTRL_LEN_BYTES = _CTRL_LEN.size
CTRL_LABEL = b"ctl"


def pack_ctrl_len(n: int) -> bytes:
    return _CTRL_LEN.pack(n)


def ctrl_len(prefix: bytes, limit: int) -> int:
    (n,) = _CTRL_LEN.unpack(prefix)
    if n > limit:
        raise ProtocolError(f"control frame of {n} bytes exceeds the {limit} byte limit")
    return n


# ---- data channel ----
# Request: REQ header, its tag, then the body (descriptors of the server's memory, request key, notification
# bytes) and the body's tag, then for a WRITE the data (and, with mac_payload, the data's tag).
OP_WRITE, OP_READ = 1, 2
# magic, op, flags, stripe, nstripes, key_len, ndescs, notif_len, xfer_id, total_bytes
REQ = struct.Struct("<4sBBHHHIIQQ")
RESP = struct.Struct("<4sBxxxIQ")  # magic, status, msg_len, xfer_id; then the message and the response's tag
MAGIC = b"PDKV"
DESC = np.dtype([("region", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_KEY_BYTES = 256
MAX_RESP_MSG = 4096
REQ_LABEL, BODY_LABEL, RESP_LABEL = b"req", b"body", b"resp"

# response status
ST_OK, ST_INVALID, ST_DENIED, ST_LIMIT, ST_PAYLOAD_MAC = 0, 1, 2, 3, 4


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


def unpack_descs(raw: bytes | memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptor columns as int64; values that do not fit (>= 2**63) are refused rather than wrapped."""
    if len(raw) % DESC.itemsize:
        raise InvalidDescriptorError("descriptor bytes are not a whole number of descriptors")
    a = np.frombuffer(raw, dtype=DESC)
    if a.size and (int(a["offset"].max()) >= 1 << 63 or int(a["length"].max()) >= 1 << 63):
        raise InvalidDescriptorError("descriptor offset or length does not fit in 63 bits")
    return a["region"].astype(np.int64), a["offset"].astype(np.int64), a["length"].astype(np.int64)

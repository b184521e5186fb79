"""A connected, authenticated peer agent: its control connection, its region table, and per-transport state.

The control connection stays open for the life of the pair, so notifications and region-table updates cost one small
write (no per-transfer handshake), and its loss is how both sides learn that the peer is gone. Every frame on it is
authenticated (pdserve.kv.auth.Session: HMAC with a per-direction sequence number).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv.auth import Session
from pdserve.kv.errors import PeerDisconnectedError, RegionError
from pdserve.kv.regions import RemoteRegion
from pdserve.kv.wire import CTRL_LABEL, CTRL_LEN_BYTES, ProtocolError, ctrl_len, decode, encode, pack_ctrl_len


def seal_frame(session: Session, msg: dict[str, Any]) -> bytes:
    body = encode(msg)
    return pack_ctrl_len(len(body)) + body + session.seal(CTRL_LABEL, body)


async def read_frame(reader: asyncio.StreamReader, session: Session, limit: int) -> dict[str, Any]:
    """The next authenticated control frame. ProtocolError when its MAC fails or it is not a map with a type (the
    connection cannot be trusted after a bad MAC); asyncio.IncompleteReadError on EOF."""
    n = ctrl_len(await reader.readexactly(CTRL_LEN_BYTES), limit)
    body = await reader.readexactly(n)
    tag = await reader.readexactly(32)
    if not session.open(tag, CTRL_LABEL, body):
        raise ProtocolError("control frame failed its authentication check")
    msg = decode(body)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("control frame is not a typed map")
    return msg


@dataclass
class Peer:
    name: str  # proven in the handshake
    address: str  # host:port the peer listens on (where data connections go)
    host_id: str
    pid: int
    transports: list[str]
    writer: asyncio.StreamWriter
    session: Session
    regions: dict[int, RemoteRegion] = field(default_factory=dict)
    hello: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # transport name -> that transport's per-peer state
    alive: bool = True
    lost_reason: str = ""
    io_timeout: float = 10.0  # longest a send may wait for the peer to read (then the peer counts as lost)

    def region_sizes(self) -> dict[int, int]:
        return {k: v.size for k, v in self.regions.items()}

    def region_id(self, name: str) -> int:
        """The peer's id of its region called `name` (how one side names the other's KV pool)."""
        for r in self.regions.values():
            if r.name == name:
                return r.region_id
        raise RegionError(f"peer {self.name} at {self.address} has no region named {name!r}; it has "
                          f"{sorted(r.name for r in self.regions.values())}")

    def describe(self) -> str:
        return f"peer {self.name} at {self.address}"

    async def send(self, msg: dict[str, Any]) -> None:
        if not self.alive:
            raise PeerDisconnectedError(f"{self.describe()} is disconnected: {self.lost_reason}")
        try:
            self.writer.write(seal_frame(self.session, msg))
            if self.writer.transport.get_write_buffer_size() > (1 << 20):
                await asyncio.wait_for(self.writer.drain(), self.io_timeout)
        except asyncio.TimeoutError as e:
            self.writer.close()  # the reader loop ends and marks the peer lost
            raise PeerDisconnectedError(f"{self.describe()}: control connection stalled: the peer read nothing "
                                        f"for {self.io_timeout:g} s") from e
        except (ConnectionError, RuntimeError, OSError) as e:
            raise PeerDisconnectedError(f"{self.describe()}: control connection failed: {e}") from e

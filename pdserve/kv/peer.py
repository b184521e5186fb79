"""A connected peer agent: its control connection, its region table, and per-transport state.

The control connection stays open for the life of the pair, so notifications and region-table updates cost one small
write (no per-transfer handshake), and its loss is how both sides learn that the peer is gone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv.errors import PeerDisconnectedError, RegionError
from pdserve.kv.regions import RemoteRegion
from pdserve.kv.wire import pack_ctrl


@dataclass
class Peer:
    name: str
    address: str  # host:port the peer listens on (where data connections go)
    host_id: str
    pid: int
    transports: list[str]
    writer: asyncio.StreamWriter
    regions: dict[int, RemoteRegion] = field(default_factory=dict)
    hello: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # transport name -> that transport's per-peer state
    alive: bool = True
    lost_reason: str = ""

    def set_regions(self, regions: list[dict[str, Any]]) -> None:
        self.regions = {int(r["id"]): RemoteRegion.from_dict(r) for r in regions}

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
            self.writer.write(pack_ctrl(msg))
            if self.writer.transport.get_write_buffer_size() > (1 << 20):
                await self.writer.drain()
        except (ConnectionError, RuntimeError, OSError) as e:
            raise PeerDisconnectedError(f"{self.describe()}: control connection failed: {e}") from e

"""What a transport may see of its agent: configuration, identity, the region table, the grants, a way to hand
over notifications it received in band, and a way to look up a connected peer's exported regions. Nothing else:
transports never import or hold the agent (pdserve.kv.agent imports the transports, not the other way round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.kv.config import AgentConfig
from pdserve.kv.grants import Grants
from pdserve.kv.regions import RegionTable, RemoteRegion

# deliver(peer, xfer_id, op, payload, key, error): thread-safe; the agent checks the key's grants before delivery
Deliver = Callable[[str, int, str, bytes, "str | None", "str | None"], None]


@dataclass(frozen=True)
class TransportContext:
    config: AgentConfig
    name: str  # this agent's name (what peers authenticate us as)
    host_id: str
    regions: RegionTable
    grants: Grants
    deliver: Deliver
    peer_regions: Callable[[str], Mapping[int, RemoteRegion]]  # a connected peer's exported regions by id

    @property
    def secret(self) -> bytes | None:
        return self.config.secret

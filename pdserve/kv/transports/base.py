"""The interface every transport implements, so the agent picks one per transfer and callers never see which."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from pdserve.kv.descs import XferList

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion


class Transport(ABC):
    """Moves bytes between registered regions of two agents.

    `transfer` returns once the bytes are in the destination memory (for a WRITE: readable by the peer's next
    kernel or read; for a READ: in our memory). It returns True when it delivered the notification itself (in band,
    after the data), False when the agent must send it on the control connection (after this return).
    """

    name: str = ""

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @classmethod
    def available(cls) -> bool:
        """Whether this process can use the transport at all (libraries importable, devices present)."""
        return True

    def export_region(self, region: MemoryRegion) -> dict[str, Any] | None:
        """Sharing information peers need for `region` (sent only to authenticated peers; None if not applicable)."""
        return None

    def on_register(self, region: MemoryRegion) -> None:
        """Called after a region is registered locally."""
        return None  # default: nothing to do

    def on_deregister(self, region: MemoryRegion) -> None:
        """Called after a region is deregistered locally."""
        return None  # default: nothing to do

    def hello_extra(self) -> dict[str, Any]:
        """Extra handshake fields (e.g. NIXL agent metadata)."""
        return {}

    async def on_peer(self, peer: Peer) -> None:
        """A peer connected or its region table changed: map its memory now so the first transfer is fast."""
        return None  # default: nothing to do

    async def on_message(self, peer: Peer, msg: dict[str, Any]) -> None:
        """A message this transport's counterpart in `peer` sent over the authenticated control connection
        (`send_message`): a side channel's set-up or a two-sided transfer's request. Validate everything in it."""
        return None  # default: nothing to do

    def on_peer_lost(self, peer: Peer) -> None:
        """The peer is gone: drop connections and mappings."""
        return None  # default: nothing to do

    async def send_message(self, peer: Peer, msg: dict[str, Any]) -> None:
        """Send `msg` to this transport's counterpart in `peer`, on the authenticated, ordered control connection."""
        await peer.send({"t": "tp", "tr": self.name, "m": msg})

    def applies(self, local: list[MemoryRegion], remote: list[RemoteRegion]) -> bool:
        """Whether this transport is meant for these kinds of memory at all (cuda_ipc: GPU memory only). One that
        does not apply is not reported as unable to serve (KVAgent.peer_transport)."""
        return True

    @abstractmethod
    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        """None if this transport can move between these regions, else the reason it cannot."""

    @abstractmethod
    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None, key: str | None = None) -> bool:
        """Move the bytes of `xfers` (op 'write': local -> remote, 'read': remote -> local) before `deadline`,
        under the peer's grant for `key` (the request id): a receiver that checks grants refuses anything else."""

    async def close(self) -> None:
        """Release everything (called once, at agent close)."""
        return None  # default: nothing to do

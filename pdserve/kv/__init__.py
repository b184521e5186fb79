"""KV transfer engine: agents that register memory, connect peer to peer, and move descriptor lists of bytes
between processes (cuda_ipc within a host, tcp anywhere, nixl when installed), with completion notifications.

    agent = KVAgent(AgentConfig(port=0, secret=load_secret())); rid = agent.register(kv_pool, name="kv")
    addr = await agent.start(); peer = await agent.connect("10.0.0.2:7000")
    await agent.write_blocks(peer, src_ids, dst_ids, block_bytes, rid, "kv", notif={"request_id": "r1"}, key="r1")

The receiving side grants first: `agent.grant_blocks("r1", "kv", dst_ids, block_bytes, "w", time.time() + 30)`.

`ThreadedAgent` offers the same from synchronous code (the event loop runs in a daemon thread).
"""

from pdserve.kv.agent import KVAgent, XferResult
from pdserve.kv.config import AgentConfig
from pdserve.kv.descs import XferList, block_xfers
from pdserve.kv.errors import (
    AccessDeniedError,
    InvalidDescriptorError,
    KVConfigError,
    KVTransferError,
    LimitExceededError,
    PeerAuthenticationError,
    PeerDisconnectedError,
    PeerUnreachableError,
    RegionError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from pdserve.kv.notify import Notification
from pdserve.kv.threaded import ThreadedAgent
from pdserve.secret import generate_secret, load_secret

__all__ = [
    "AccessDeniedError",
    "AgentConfig",
    "InvalidDescriptorError",
    "KVAgent",
    "KVConfigError",
    "KVTransferError",
    "LimitExceededError",
    "Notification",
    "PeerAuthenticationError",
    "PeerDisconnectedError",
    "PeerUnreachableError",
    "RegionError",
    "ThreadedAgent",
    "TransferTimeoutError",
    "TransportUnavailableError",
    "XferList",
    "XferResult",
    "block_xfers",
    "generate_secret",
    "load_secret",
]

"""Errors of the KV transfer engine.

One hierarchy so callers (the disaggregation layer) can catch `KVTransferError` and decide between retrying,
recomputing or failing the request, while the message always says which peer, address and transfer failed.
"""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """Base class of every error raised by `pdserve.kv`."""


class InvalidDescriptorError(KVTransferError, ValueError):
    """A transfer descriptor falls outside a registered region, overlaps another destination, or is malformed."""


class RegionError(KVTransferError, KeyError):
    """A region id or name is unknown, or a region was deregistered twice."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PeerUnreachableError(KVTransferError, ConnectionError):
    """Connecting to a peer failed (refused, timed out, handshake rejected); the message names the address."""


class PeerDisconnectedError(KVTransferError, ConnectionError):
    """The peer went away (closed, crashed, reset) before or during a transfer."""


class TransferTimeoutError(KVTransferError, TimeoutError):
    """A transfer or a wait did not finish within its deadline."""


class TransportUnavailableError(KVTransferError):
    """The requested transport cannot serve this pair of regions or is not installed."""


class PeerAuthenticationError(PeerUnreachableError):
    """The handshake failed: the peer did not prove the deployment secret, or refused our proof. The message starts
    with "KV peer authentication failed"."""


class AccessDeniedError(KVTransferError, PermissionError):
    """The receiving agent refused a transfer: no live grant for its key (and peer) covers its descriptors."""


class LimitExceededError(KVTransferError):
    """A request exceeds a bound of the receiving agent (descriptors per transfer, frame or payload size)."""


class KVConfigError(KVTransferError, ValueError):
    """The agent's configuration is unusable (e.g. no secret and not explicitly insecure)."""

"""Notifications: how a receiver learns that a transfer's bytes landed (or that it failed).

Three ways to consume them, for the three kinds of callers: callbacks (run on the agent's loop, for code that hands
off to its own queue), `wait` (await one matching notification, bounded by a timeout, failed at once when its peer
disconnects), and `poll` (take everything queued: the synchronous engine loop's way).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve.kv.errors import KVTransferError, PeerDisconnectedError, TransferTimeoutError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Notification:
    """Sent by the initiator after a transfer completed. op 'write': the bytes are in our memory now;
    op 'read': the peer finished reading our memory (the blocks may be released); op 'notify': no data.

    `error` is set when the initiator reports that the transfer carrying this payload FAILED (its bytes must not be
    used); `wait_notification` raises for such notifications, callbacks see them and must check `error`.
    """

    peer: str  # the sender's name, as proven in its handshake
    xfer_id: int
    op: str
    payload: bytes  # what the sender chose to send: validate before use (payload_dict() never raises)
    recv_ns: int  # time.perf_counter_ns() at arrival (CLOCK_MONOTONIC: comparable across processes on Linux)
    error: str | None = None
    # the transfer's key (request id). With access control on, a notification is delivered only if a live grant
    # of this key admits `peer`: trust `key`, not a request id inside the payload
    key: str | None = None

    def raise_if_failed(self) -> Notification:
        if self.error is not None:
            raise KVTransferError(f"{self.op} {self.xfer_id} from peer {self.peer} failed: {self.error}")
        return self

    def unpack(self) -> Any:
        """The payload decoded as msgpack (the convention for {"request_id": ..., ...} payloads); a payload that
        is not msgpack raises KVTransferError."""
        try:
            return msgpack.unpackb(self.payload, raw=False)
        except Exception as e:  # msgpack raises several unrelated types on bad input
            raise KVTransferError(f"notification {self.xfer_id} from peer {self.peer} is not msgpack: "
                                  f"{type(e).__name__}") from None

    def payload_dict(self) -> dict[str, Any] | None:
        """The payload as a msgpack map with string keys, or None when it is anything else. Never raises: what a
        peer sends must not be able to fail the caller (check each field's type before use too)."""
        try:
            d = msgpack.unpackb(self.payload, raw=False)
        except Exception:  # any undecodable payload is simply not a dict
            return None
        return d if isinstance(d, dict) and all(isinstance(k, str) for k in d) else None


def encode_notif(notif: bytes | dict[str, Any] | None) -> bytes | None:
    if notif is None or isinstance(notif, bytes):
        return notif
    if isinstance(notif, (bytearray, memoryview)):
        return bytes(notif)
    return msgpack.packb(notif, use_bin_type=True)


class Notifications:
    """Delivery of notifications to callbacks, waiters and a bounded queue (all on the agent's event loop)."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._queue: collections.deque[Notification] = collections.deque()
        self._waiters: list[tuple[str | None, Callable[[Notification], bool] | None, asyncio.Future]] = []
        self._callbacks: list[Callable[[Notification], None]] = []

    def add_callback(self, cb: Callable[[Notification], None]) -> None:
        self._callbacks.append(cb)

    def deliver(self, n: Notification) -> None:
        """Callbacks see every notification; then the first matching waiter takes it; else it is queued (unless
        callbacks are registered: then nobody would drain the queue)."""
        for cb in list(self._callbacks):
            try:
                cb(n)
            except Exception:
                log.exception("notification callback failed")
        for i, (peer, pred, fut) in enumerate(self._waiters):
            if fut.done() or (peer is not None and peer != n.peer) or (pred is not None and not pred(n)):
                continue
            if n.error is not None:
                fut.set_exception(KVTransferError(f"{n.op} {n.xfer_id} from peer {n.peer} failed: {n.error}"))
            else:
                fut.set_result(n)
            del self._waiters[i]
            return
        if not self._callbacks:
            if len(self._queue) >= self.max_queued:
                dropped = self._queue.popleft()
                log.warning("notification queue full: dropped %s from %s", dropped.xfer_id, dropped.peer)
            self._queue.append(n)

    def poll(self) -> list[Notification]:
        out = list(self._queue)
        self._queue.clear()
        return out

    def take_queued(self, peer: str | None, predicate: Callable[[Notification], bool] | None) -> Notification | None:
        for i, n in enumerate(self._queue):
            if (peer is None or n.peer == peer) and (predicate is None or predicate(n)):
                del self._queue[i]
                return n.raise_if_failed()
        return None

    async def wait(self, peer: str | None, predicate: Callable[[Notification], bool] | None,
                   timeout: float) -> Notification:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (peer, predicate, fut)
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"no notification from {peer or 'any peer'} within {timeout:g} s") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def fail_peer(self, peer: str, message: str) -> None:
        """The peer is gone: whoever waits for its notifications is told now."""
        for name, _, fut in self._waiters:
            if name == peer and not fut.done():
                fut.set_exception(PeerDisconnectedError(message))

    def close(self) -> None:
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(PeerDisconnectedError("agent closed"))

"""A synchronous facade over `KVAgent` for the engine's hot loop (plain Python, no asyncio).

The agent's event loop runs in a daemon thread. Transfers return `concurrent.futures.Future`s at once, so an engine
step can start a push, keep scheduling, and check `future.done()` on a later step; blocking calls take a timeout;
notification and peer-lost callbacks run on the agent's thread (keep them short: hand off to a queue).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.kv.agent import KVAgent, XferResult
from pdserve.kv.config import AgentConfig
from pdserve.kv.descs import XferList
from pdserve.kv.errors import TransferTimeoutError
from pdserve.kv.notify import Notification


class ThreadedAgent:
    def __init__(self, config: AgentConfig | None = None, start_timeout: float = 30.0, **overrides: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kv-agent-loop", daemon=True)
        self._thread.start()
        self.agent = KVAgent(config, **overrides)
        self._closed = False
        self.address: str = self._call(self.agent.start(), start_timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Run a coroutine on the agent's loop (for KVAgent methods not wrapped here)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferTimeoutError(f"KV agent call did not finish within {timeout} s") from None

    async def _sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    @property
    def name(self) -> str:
        return self.agent.name

    def register(self, obj: Any, name: str | None = None, timeout: float = 30.0, unit_bytes: int = 0) -> int:
        return self._call(self._sync(self.agent.register, obj, name, unit_bytes), timeout)

    def grant(self, key: str, region: int | str, ranges: Any, mode: str, deadline: float,
              peer: str | None = None) -> None:
        """KVAgent.grant, called directly (thread-safe, no hop to the agent's loop: cheap from an engine step)."""
        self.agent.grant(key, region, ranges, mode, deadline, peer)

    def grant_blocks(self, key: str, region: int | str, block_ids: Any, block_bytes: int, mode: str,
                     deadline: float, peer: str | None = None) -> None:
        self.agent.grant_blocks(key, region, block_ids, block_bytes, mode, deadline, peer)

    def revoke(self, key: str) -> int:
        """KVAgent.revoke, called directly (thread-safe)."""
        return self.agent.revoke(key)

    def deregister(self, region_id: int, timeout: float = 30.0) -> None:
        self._call(self._sync(self.agent.deregister, region_id), timeout)

    def connect(self, target: str, timeout: float | None = None) -> str:
        t = timeout or self.agent.config.connect_timeout_s
        return self._call(self.agent.connect(target, t), t + 1.0)

    def write(self, peer: str, xfers: XferList, notif: Any = None, **kw: Any) -> concurrent.futures.Future:
        """Start a WRITE (keywords as KVAgent.write, `key=` included); the future resolves to an XferResult (or
        raises KVTransferError)."""
        return self.submit(self.agent.write(peer, xfers, notif, **kw))

    def read(self, peer: str, xfers: XferList, notif: Any = None, **kw: Any) -> concurrent.futures.Future:
        return self.submit(self.agent.read(peer, xfers, notif, **kw))

    def write_blocks(self, peer: str, src_ids: Any, dst_ids: Any, block_bytes: int, local_region: int,
                     remote_region: int | str, notif: Any = None, **kw: Any) -> concurrent.futures.Future:
        return self.submit(self.agent.write_blocks(peer, src_ids, dst_ids, block_bytes, local_region, remote_region,
                                                   notif, **kw))

    def read_blocks(self, peer: str, remote_ids: Any, local_ids: Any, block_bytes: int, local_region: int,
                    remote_region: int | str, notif: Any = None, **kw: Any) -> concurrent.futures.Future:
        return self.submit(self.agent.read_blocks(peer, remote_ids, local_ids, block_bytes, local_region, remote_region,
                                                  notif, **kw))

    def notify(self, peer: str, payload: Any, key: str | None = None) -> concurrent.futures.Future:
        return self.submit(self.agent.notify(peer, payload, key))

    def on_notification(self, cb: Callable[[Notification], None]) -> None:
        """`cb` runs on the agent's thread for every notification (queued ones are then not kept)."""
        self._call(self._sync(self.agent.on_notification, cb), 10.0)  # registered before this returns

    def on_peer_lost(self, cb: Callable[[str, str], None]) -> None:
        self._call(self._sync(self.agent.on_peer_lost, cb), 10.0)

    def poll_notifications(self, timeout: float = 5.0) -> list[Notification]:
        return self._call(self._sync(self.agent.poll_notifications), timeout)

    def wait_notification(self, peer: str | None = None, predicate: Callable[[Notification], bool] | None = None,
                          timeout: float = 30.0) -> Notification:
        return self._call(self.agent.wait_notification(peer, predicate, timeout), timeout + 1.0)

    def peer_transports(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """KVAgent.peer_transports: per connected peer, the transport its transfers take and why each faster one
        cannot serve (for /metrics)."""
        return self._call(self._sync(self.agent.peer_transports), timeout)

    def peer_address(self, peer: str) -> str:
        """The address a connected peer's agent listens on ("host:port"); its name when it is not connected."""
        p = self.agent.peers.get(peer)
        return p.address if p is not None and p.address else peer

    def peer_region_id(self, peer: str, name: str) -> int:
        return self.agent.peer(peer).region_id(name)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.agent.close(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> ThreadedAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ThreadedAgent", "XferResult"]

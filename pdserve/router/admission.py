"""Admission: a bounded FIFO queue in front of the decode-side instances.

A request is admitted at once while some healthy decode (or both) instance is under its limits; otherwise it
waits in the router's queue, which is bounded in length and in time. Beyond either bound it is refused with
503 + Retry-After, so overload is shed explicitly instead of growing every instance's queue without limit.
When every healthy instance reports (in /load) that a new request would wait longer than its latency budget, the
request is refused at once: queueing it in the router would only move the wait, not shorten it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Instance, Pools


class Rejected(Exception):
    """Admission refused the request: `status` (503/429) and a message for the client."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, config: RouterConfig, pools: Pools, metrics: RouterMetrics) -> None:
        self.config = config
        self.pools = pools
        self.metrics = metrics
        self._waiters: deque[asyncio.Future[None]] = deque()

    def targets(self) -> list[Instance]:
        """Healthy instances a request can be sent to (decode side)."""
        return self.pools.available("decode") + self.pools.available("both")

    def is_full(self, inst: Instance) -> bool:
        if inst.inflight >= self.config.max_inflight_per_instance:
            return True
        load = inst.load
        return load is not None and (load.num_waiting > self.config.max_waiting_per_instance or load.over_budget)

    def over_budget(self, targets: list[Instance]) -> float | None:
        """When every target is over its latency budget: the seconds until the first is expected back under it."""
        loads = [t.load for t in targets]
        if not targets or not all(ld is not None and ld.over_budget for ld in loads):
            return None
        return min(ld.queue_wait_s - ld.max_queue_wait_s for ld in loads)  # type: ignore[union-attr]

    def spare(self) -> int:
        """How many more requests the healthy, non-full targets can take right now."""
        return sum(
            self.config.max_inflight_per_instance - t.inflight for t in self.targets() if not self.is_full(t)
        )

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> float:
        """Wait for admission; returns the seconds waited. Raises Rejected when the request must be refused."""
        start = time.monotonic()
        if not self.targets():
            self.metrics.rejected.labels("no_healthy_instance").inc()
            raise Rejected(503, "no_healthy_instance", "no healthy decode instance is available")
        excess = self.over_budget(self.targets())
        if excess is not None:
            self.metrics.rejected.labels("over_budget").inc()
            raise Rejected(503, "over_budget", "every instance is over its latency budget; retry later",
                           max(float(self.config.retry_after_s), excess))
        if not self._waiters and self.spare() > 0:
            self.metrics.router_queue.observe(0.0)
            return 0.0
        if len(self._waiters) >= self.config.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise Rejected(503, "queue_full", "every instance is at its limit and the router queue is full")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.metrics.queue_depth.set(len(self._waiters))
        try:
            await asyncio.wait_for(fut, timeout=self.config.queue_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("queue_timeout").inc()
            raise Rejected(
                503, "queue_timeout", f"no instance had capacity within {self.config.queue_timeout_s:.0f}s"
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.wake()  # we were admitted but the client left: pass the slot on
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
            self.metrics.queue_depth.set(len(self._waiters))
        waited = time.monotonic() - start
        self.metrics.router_queue.observe(waited)
        return waited

    def wake(self) -> None:
        """Admit as many queued requests as there is spare capacity (call when capacity may have freed)."""
        if not self._waiters:
            return
        if not self.targets():  # everything went down while they waited: tell them now, not at the timeout
            self.metrics.rejected.labels("no_healthy_instance").inc(len(self._waiters))
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_exception(Rejected(503, "no_healthy_instance", "no healthy decode instance is available"))
            self.metrics.queue_depth.set(0)
            return
        spare = self.spare()
        while spare > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                spare -= 1
        self.metrics.queue_depth.set(len(self._waiters))

    async def run_waker(self) -> None:
        """Wake queued requests after every health poll round (instances' queues drain between polls)."""
        while True:
            await self.pools.changed.wait()
            self.pools.changed.clear()
            self.wake()

"""Instance pools: load polling, health, and a circuit breaker per instance.

Why poll `/load` rather than `/health`: one cheap GET every ~200 ms gives both liveness and the queue sizes the
policies need. Between polls the router adds what it dispatched itself (`pending_tokens`, `inflight`), so a burst
does not all land on the instance that looked idle at the last poll.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.router.config import ROLES, RouterConfig
from pdserve.router.prefix import PrefixIndex

log = logging.getLogger("pdserve.router")


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive failures open it; after a cool-down it is half-open and the next health probe decides.

    Requests go only to CLOSED instances: a half-open instance is probed by the health poller (a cheap GET)
    instead of by a client's request, so no client pays for finding out that an instance is still down.
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
        return self._state

    @property
    def allows_requests(self) -> bool:
        return self.state is BreakerState.CLOSED

    def record_success(self) -> BreakerState:
        self.consecutive_failures = 0
        if self.state is not BreakerState.OPEN:  # a late success from before opening does not close it early
            self._state = BreakerState.CLOSED
        return self._state

    def record_failure(self) -> BreakerState:
        self.consecutive_failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self.consecutive_failures >= self.threshold
        ):
            self.trip()
        return self._state

    def trip(self) -> None:
        """Open now (a hard failure such as a connection lost mid-stream needs no three strikes)."""
        self._state = BreakerState.OPEN
        self.opened_at = self.clock()


LOAD_FIELDS = ("num_running", "num_waiting", "running_tokens", "waiting_tokens", "kv_usage",
               "num_free_blocks", "num_total_blocks", "queue_wait_s", "max_queue_wait_s")


@dataclass
class LoadSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    running_tokens: int = 0
    waiting_tokens: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    queue_wait_s: float = 0.0  # the instance's estimate of how long a new request would wait to start
    max_queue_wait_s: float = 0.0  # its latency budget (0: none)
    role: str | None = None

    @property
    def over_budget(self) -> bool:
        """The instance would refuse a new request: its estimated wait exceeds its budget."""
        return self.max_queue_wait_s > 0 and self.queue_wait_s > self.max_queue_wait_s

    @classmethod
    def from_json(cls, data: Any) -> LoadSnapshot:
        if not isinstance(data, dict):
            raise ValueError(f"/load returned {type(data).__name__}, expected an object")
        kwargs: dict[str, Any] = {}
        for name in LOAD_FIELDS:
            value = data.get(name, 0)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"/load field {name} is {value!r}, expected a number")
            kwargs[name] = value
        role = data.get("role")
        return cls(role=role if isinstance(role, str) else None, **kwargs)


class Instance:
    """One upstream instance as the router sees it."""

    def __init__(self, url: str, role: str, config: RouterConfig, clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.role = role
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self.load: LoadSnapshot | None = None
        self.last_poll_ok: float | None = None
        self.inflight = 0  # requests the router has outstanding here (as decode/both target)
        self.pending_tokens = 0  # prompt tokens dispatched here since the last load snapshot
        self.prefix = PrefixIndex(config.prefix_cache_chunks)
        self.active: set[Callable[[str], None]] = set()  # cancel hooks of requests streaming from here

    def __repr__(self) -> str:
        return f"Instance({self.url}, {self.role}, {self.breaker.state.value})"

    @property
    def available(self) -> bool:
        return self.breaker.allows_requests

    @property
    def load_tokens(self) -> int:
        """Queued + running tokens, including what the router sent since the last poll."""
        snap = self.load
        base = (snap.running_tokens + snap.waiting_tokens) if snap else 0
        return base + self.pending_tokens

    @property
    def waiting_tokens(self) -> int:
        return (self.load.waiting_tokens if self.load else 0) + self.pending_tokens

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "state": self.breaker.state.value,
            "consecutive_failures": self.breaker.consecutive_failures,
            "inflight": self.inflight,
            "pending_tokens": self.pending_tokens,
            "load": vars(self.load) if self.load else None,
            "prefix_chunks": len(self.prefix),
        }


StateListener = Callable[[Instance, BreakerState, BreakerState], None]


class Pools:
    """The prefill, decode and both pools, and the task that polls them."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.by_role: dict[str, list[Instance]] = {
            role: [Instance(url, role, config, clock) for url in getattr(config, role)] for role in ROLES
        }
        self.by_url: dict[str, Instance] = {i.url: i for insts in self.by_role.values() for i in insts}
        self.listeners: list[StateListener] = []
        self.changed = asyncio.Event()  # set after each poll round: capacity may have freed
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    def __iter__(self):
        return iter(self.by_url.values())

    def available(self, role: str) -> list[Instance]:
        return [i for i in self.by_role[role] if i.available]

    # ---- outcome reporting (from polls and from requests) ----

    def _transition(self, inst: Instance, old: BreakerState) -> None:
        new = inst.breaker.state
        if new is old:
            return
        log.warning("instance %s (%s): %s -> %s", inst.url, inst.role, old.value, new.value)
        inst.prefix.clear()  # every transition passes through "down": the instance may have restarted
        for listener in self.listeners:
            listener(inst, old, new)

    def report_success(self, inst: Instance) -> None:
        old = inst.breaker.state
        inst.breaker.record_success()
        self._transition(inst, old)

    def report_failure(self, inst: Instance, hard: bool = False) -> None:
        """`hard`: the failure proves the instance is gone (connection refused/reset), open at once."""
        old = inst.breaker.state
        if hard:
            inst.breaker.consecutive_failures += 1
            inst.breaker.trip()
            # proof it is gone: end its streams now rather than at a read timeout; a merely slow instance
            # (poll timeouts) gets no new requests but keeps serving the ones it has
            for cancel in list(inst.active):
                cancel(f"instance {inst.url} is down (connection refused)")
        else:
            inst.breaker.record_failure()
        self._transition(inst, old)

    # ---- polling ----

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        targets = [i for i in self if i.breaker.state is not BreakerState.OPEN]
        await asyncio.gather(*(self._poll(session, i) for i in targets))
        self.changed.set()

    async def _poll(self, session: aiohttp.ClientSession, inst: Instance) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with session.get(inst.url + "/load", timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"/load answered HTTP {resp.status}")
                data = await resp.json(content_type=None)
                snap = LoadSnapshot.from_json(data)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.debug("poll %s failed: %r", inst.url, exc)
            self.report_failure(inst, hard=isinstance(exc, aiohttp.ClientConnectorError))
            return
        if data.get("engine_alive") is False:  # the HTTP front answers but its engine is gone: as good as dead
            log.debug("poll %s: engine not alive", inst.url)
            self.report_failure(inst, hard=True)
            return
        if snap.role and snap.role != inst.role:
            log.warning("instance %s reports role %s but is configured as %s", inst.url, snap.role, inst.role)
        inst.load = snap
        inst.pending_tokens = 0
        inst.last_poll_ok = time.monotonic()
        self.report_success(inst)

    async def _poll_loop(self, session: aiohttp.ClientSession) -> None:
        interval = self.config.health_interval_s
        started = time.monotonic()  # start() has just done a round
        while True:
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
            started = time.monotonic()
            try:
                await self.poll_once(session)
            except Exception:  # never let the health loop die silently
                log.exception("health poll round failed")

    async def start(self, session: aiohttp.ClientSession) -> None:
        """First poll round (bounded by `startup_wait_s`), then poll in the background."""
        self._session = session
        try:
            await asyncio.wait_for(self.poll_once(session), timeout=max(self.config.startup_wait_s, 0.01))
        except asyncio.TimeoutError:
            log.warning("first health poll round did not finish within %.1fs", self.config.startup_wait_s)
        self._task = asyncio.create_task(self._poll_loop(session), name="pdserve-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

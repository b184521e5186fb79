"""Find the highest request rate at which the SLO holds: probe upward exponentially, then bisect.

The search itself is a pure function of a `trial(rate) -> Trial` callback (so it is tested against known
thresholds without a server); `trial_size` and `SearchConfig` decide how much load each trial sends.
Rates from `start_rate` grow by `growth` until a trial fails (or `max_rate` passes); if the first rate already
fails, the search probes downward. Then it bisects [highest pass, lowest fail] until the bracket is within
`tolerance` of its lower end, `max_trials` are spent, the time budget runs out, or the user interrupts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class SearchConfig:
    start_rate: float = 1.0
    growth: float = 2.0
    max_rate: float = 1024.0
    min_rate: float = 0.05
    tolerance: float = 0.1  # stop when (fail - pass) <= tolerance * pass
    max_trials: int = 24
    requests_per_rate: float = 5.0  # each trial sends at least 5 x rate requests ...
    min_duration_s: float = 0.0  # ... and arrivals spanning at least this long
    min_requests: int = 10
    max_requests: int | None = None
    max_duration_s: float | None = None  # cap on a trial's arrival window
    time_budget_s: float | None = None  # the whole search
    cooldown_s: float = 2.0  # idle time before each trial after the first, so an overloaded one drains away

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start_rate <= self.max_rate:
            raise ValueError(f"need 0 < min_rate <= start_rate <= max_rate, got {self.min_rate}, "
                             f"{self.start_rate}, {self.max_rate}")
        if self.growth <= 1.0:
            raise ValueError(f"--growth must be above 1, got {self.growth}")
        if self.tolerance <= 0:
            raise ValueError(f"--tolerance must be positive, got {self.tolerance}")


def trial_size(rate: float, cfg: SearchConfig) -> int:
    n = max(math.ceil(cfg.requests_per_rate * rate), math.ceil(rate * cfg.min_duration_s), cfg.min_requests)
    if cfg.max_requests is not None:
        n = min(n, cfg.max_requests)
    return max(n, 1)


@dataclass
class Trial:
    rate: float
    passed: bool | None  # None: inconclusive (interrupted, out of time)
    reason: str = ""
    values: dict = field(default_factory=dict)
    run_index: int | None = None
    goodput: float | None = None
    num_sent: int = 0


@dataclass
class SearchResult:
    max_rate: float | None  # the highest rate that passed; None if none did
    min_failed_rate: float | None
    stop_reason: str
    trials: list[Trial]

    @property
    def best_trial(self) -> Trial | None:
        passing = [t for t in self.trials if t.passed and t.rate == self.max_rate]
        return passing[-1] if passing else None


async def search_max_rate(
    trial: Callable[[float, float | None], Awaitable[Trial]], cfg: SearchConfig
) -> SearchResult:
    """`trial(rate, seconds_left)` runs one trial; seconds_left is the remaining time budget (None: unlimited)."""
    t_start = time.monotonic()
    trials: list[Trial] = []
    lo: float | None = None
    hi: float | None = None

    def left() -> float | None:
        return None if cfg.time_budget_s is None else cfg.time_budget_s - (time.monotonic() - t_start)

    async def run(rate: float) -> bool | None:
        nonlocal lo, hi
        t = await trial(rate, left())
        trials.append(t)
        if t.passed is True:
            lo = rate if lo is None else max(lo, rate)
        elif t.passed is False:
            hi = rate if hi is None else min(hi, rate)
        return t.passed

    def stop_now() -> str | None:
        if len(trials) >= cfg.max_trials:
            return "max_trials"
        remaining = left()
        if remaining is not None and remaining <= 0:
            return "time_budget"
        return None

    def finish(reason: str) -> SearchResult:
        return SearchResult(max_rate=lo, min_failed_rate=hi, stop_reason=reason, trials=trials)

    rate = cfg.start_rate
    while True:  # probe upward
        if (why := stop_now()) is not None:
            return finish(why)
        ok = await run(rate)
        if ok is None:
            return finish(trials[-1].reason or "inconclusive trial")
        if not ok:
            break
        if rate >= cfg.max_rate:
            return finish("max_rate_passed")
        rate = min(rate * cfg.growth, cfg.max_rate)
    if lo is None:  # the start rate failed: probe downward
        rate = cfg.start_rate / cfg.growth
        while lo is None:
            if rate < cfg.min_rate:
                return finish("below_min_rate")
            if (why := stop_now()) is not None:
                return finish(why)
            ok = await run(rate)
            if ok is None:
                return finish(trials[-1].reason or "inconclusive trial")
            rate /= cfg.growth
    while hi - lo > cfg.tolerance * lo:  # bisect
        if (why := stop_now()) is not None:
            return finish(why)
        if await run((lo + hi) / 2.0) is None:
            return finish(trials[-1].reason or "inconclusive trial")
    return finish("converged")

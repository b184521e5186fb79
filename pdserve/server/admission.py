"""Admission by latency budget: a request that cannot start within `max_queue_wait_s` is refused at once (503 with
Retry-After), instead of joining a queue it would sit in for minutes.

The estimate is Little's law on what this server sees: the requests it admitted that have not produced their first
output yet (`pending`: the engine's waiting queue plus prefills in progress), divided by the rate at which requests
start (first output), measured over the last starts while something was pending (idle time does not dilute it).
Two guards make it safe when the estimate is unknown or wrong: a request is refused when the oldest pending request
has already waited longer than the budget (FCFS: the newcomer would wait at least as long), and an admitted request
that still has not started by its deadline is aborted with the same 503 (the handler enforces that with
`start_deadline_s`). So no admitted request waits silently past its budget.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pdserve import protocol as P

WINDOW_STARTS = 64  # starts the rate is measured over
MIN_PREFILL_TOKENS_PER_S = 256.0  # floor of the prefill rate used for a request's own start deadline


class Admission:
    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s = budget_s  # 0: admission by budget is off (the engine's --max-waiting still applies)
        self.clock = clock
        self.pending: dict[str, float] = {}  # request id -> admitted at
        self._gaps: deque[float] = deque(maxlen=WINDOW_STARTS)  # busy time between consecutive starts
        self._tokens: deque[tuple[float, int]] = deque(maxlen=WINDOW_STARTS)  # (busy gap, prompt tokens started)
        self._last_start = 0.0
        self._busy_since = 0.0

    @property
    def enabled(self) -> bool:
        return self.budget_s > 0

    def start_rate(self) -> float | None:
        """Requests starting per second while the server had pending requests (None: not measured yet)."""
        busy = sum(self._gaps)
        if len(self._gaps) < 2 or busy <= 0:
            return None
        return len(self._gaps) / busy

    def prefill_rate(self) -> float:
        """Prompt tokens started per busy second (a floor where unmeasured)."""
        busy = sum(g for g, _ in self._tokens)
        tokens = sum(n for _, n in self._tokens)
        return max(MIN_PREFILL_TOKENS_PER_S, tokens / busy) if busy > 0 else MIN_PREFILL_TOKENS_PER_S

    def oldest_wait(self) -> float:
        if not self.pending:
            return 0.0
        return self.clock() - min(self.pending.values())

    def estimate_wait(self, ahead: int | None = None) -> float:
        """Seconds a request arriving now would wait before it starts (0 when nothing is pending)."""
        ahead = len(self.pending) if ahead is None else ahead
        if ahead == 0:
            return 0.0
        rate = self.start_rate()
        by_rate = ahead / rate if rate else 0.0
        return max(by_rate, self.oldest_wait())

    def check(self, num_requests: int = 1) -> None:
        """Raise 503 + Retry-After when `num_requests` more would not start within the budget."""
        if not self.enabled:
            return
        wait = self.estimate_wait(len(self.pending) + num_requests - 1)
        if wait > self.budget_s:
            raise P.overloaded(
                f"The server is overloaded: a new request would wait about {wait:.1f} s before it starts, "
                f"more than the {self.budget_s:g} s budget; retry later", max(1.0, wait - self.budget_s),
                code="over_budget")

    def start_deadline_s(self, prompt_tokens: int) -> float | None:
        """How long an admitted request may go without its first output: the budget plus its own prefill."""
        if not self.enabled:
            return None
        return self.budget_s + prompt_tokens / self.prefill_rate()

    def admitted(self, rid: str) -> None:
        now = self.clock()
        if not self.pending:
            self._busy_since = now
        self.pending[rid] = now

    def started(self, rid: str, prompt_tokens: int) -> None:
        if self.pending.pop(rid, None) is None:
            return
        now = self.clock()
        gap = now - max(self._last_start, self._busy_since)
        self._gaps.append(gap)
        self._tokens.append((gap, prompt_tokens))
        self._last_start = now
        if not self.pending:
            self._busy_since = math.inf  # idle from here: the next start's gap counts from the next admission

    def done(self, rid: str) -> None:
        """The request ended (or was refused) without starting."""
        self.pending.pop(rid, None)

    def snapshot(self) -> dict:
        rate = self.start_rate()
        return {
            "num_pending": len(self.pending),
            "queue_wait_s": round(self.estimate_wait(), 3),
            "max_queue_wait_s": self.budget_s,
            "start_rate": round(rate, 3) if rate else None,
        }

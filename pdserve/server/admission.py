"""Admission by latency budget: a request that cannot start within `max_queue_wait_s` is refused at once (503 with
Retry-After), instead of joining a queue it would sit in for minutes.

With continuous batching a request waits only while the engine's waiting queue is non-empty (every slot or KV
block taken); otherwise it joins the next step. So the estimate for a newcomer is the engine's waiting queue
(`num_waiting` from its stats) divided by the rate at which requests leave it, measured as the rate of first
outputs over recent starts that happened while the queue was non-empty (idle and unqueued time do not dilute it).
For every request that produced its first output, the engine's `first_scheduled_time` separates its prefill
(first token - scheduled) from its wait. Two guards make it safe when the estimate is unknown or wrong: a request
is refused when the oldest request still without output has waited longer than the budget plus a typical prefill
(FCFS: the newcomer would wait at least as long), and an admitted request that has no first output by
`start_deadline_s` (budget plus an allowance for its own prefill) is aborted with the same 503. So no admitted
request waits silently past its budget.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pdserve import protocol as P

WINDOW_STARTS = 64  # starts the rates are measured over


class Admission:
    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic,
                 waiting: Callable[[], int] = lambda: 0):
        self.budget_s = budget_s  # 0: admission by budget is off (the engine's --max-waiting still applies)
        self.clock = clock
        self.waiting = waiting  # requests in the engine's waiting queue (from its last stats)
        self.pending: dict[str, float] = {}  # request id -> admitted at
        self._gaps: deque[float] = deque(maxlen=WINDOW_STARTS)  # busy time between consecutive starts
        self._prefills: deque[tuple[float, int]] = deque(maxlen=WINDOW_STARTS)  # (prefill seconds, prompt tokens)
        self._last_start = 0.0
        self._busy_since = math.inf

    @property
    def enabled(self) -> bool:
        return self.budget_s > 0

    def start_rate(self) -> float | None:
        """Requests starting per second while the engine had a waiting queue (None: not measured yet)."""
        busy = sum(self._gaps)
        if len(self._gaps) < 2 or busy <= 0:
            return None
        return len(self._gaps) / busy

    def typical_prefill_s(self) -> float:
        """The median time from scheduling to first token of recent requests (0 unmeasured)."""
        if not self._prefills:
            return 0.0
        return sorted(p for p, _ in self._prefills)[len(self._prefills) // 2]

    def prefill_allowance_s(self, prompt_tokens: int) -> float:
        """Time granted to a request's own prefill on top of the budget: twice the slowest recent prefill, scaled
        up for a longer prompt (the budget itself while nothing has been measured)."""
        if not self._prefills:
            return self.budget_s
        return 2 * max(p * max(1.0, prompt_tokens / max(1, n)) for p, n in self._prefills)

    def oldest_wait(self) -> float:
        if not self.pending:
            return 0.0
        return self.clock() - min(self.pending.values())

    def estimate_wait(self, extra: int = 0) -> float:
        """Seconds a request arriving now (after `extra` others) would wait in the queue before it is scheduled."""
        self._observe()
        waiting = self.waiting()
        rate = self.start_rate()
        by_rate = (waiting + extra + 1) / rate if waiting and rate else 0.0
        return max(by_rate, self.oldest_wait() - self.typical_prefill_s(), 0.0)

    def check(self, num_requests: int = 1) -> None:
        """Raise 503 + Retry-After when `num_requests` more would not start within the budget."""
        if not self.enabled:
            return
        wait = self.estimate_wait(num_requests - 1)
        if wait > self.budget_s:
            raise P.overloaded(
                f"The server is overloaded: a new request would wait about {wait:.1f} s before it starts, "
                f"more than the {self.budget_s:g} s budget; retry later", max(1.0, wait - self.budget_s),
                code="over_budget")

    def start_deadline_s(self, prompt_tokens: int) -> float | None:
        """How long an admitted request may go without its first output: the budget plus its own prefill."""
        if not self.enabled:
            return None
        return self.budget_s + self.prefill_allowance_s(prompt_tokens)

    def _observe(self) -> None:
        """Track when the engine's waiting queue became non-empty (sampled at every event)."""
        if self.waiting() > 0:
            if self._busy_since == math.inf:
                self._busy_since = self.clock()
        else:
            self._busy_since = math.inf

    def admitted(self, rid: str) -> None:
        self._observe()
        self.pending[rid] = self.clock()

    def started(self, rid: str, prompt_tokens: int, first_output: Any = None) -> None:
        """`first_output` (a RequestOutput) gives the engine's scheduling time, separating queue from prefill."""
        if self.pending.pop(rid, None) is None:
            return
        now = self.clock()
        queued_since = self._busy_since
        self._observe()
        if queued_since != math.inf:  # a start while requests were queued: it measures the drain rate
            self._gaps.append(now - max(self._last_start, queued_since))
        self._last_start = now
        scheduled = getattr(first_output, "first_scheduled_time", None)
        first_token = getattr(first_output, "first_token_time", None) or time.time()
        if isinstance(scheduled, (int, float)) and scheduled > 0:
            self._prefills.append((max(0.0, first_token - scheduled), prompt_tokens))

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

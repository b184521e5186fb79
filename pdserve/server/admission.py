"""Admission by latency budget: a request that cannot start within `max_queue_wait_s` is refused at once (503 with
Retry-After), instead of joining a queue it would sit in for minutes.

What is measured: for every request that produced its first output, when it was admitted, when the engine first
scheduled it (`first_scheduled_time`) and when its first token arrived. Its queue wait is scheduled - arrival, its
prefill first token - scheduled. The estimate for a newcomer is Little's law on what this server sees: the requests
admitted that have not produced a first output yet (`pending`: the engine's waiting queue plus prefills in
progress) divided by the rate at which requests start, measured over recent starts while something was pending
(idle time does not dilute it), minus a typical prefill. Two guards make it safe when the estimate is unknown or
wrong: a request is refused when the oldest pending request has already waited longer than the budget plus a
prefill (FCFS: the newcomer would wait at least as long), and an admitted request that has no first output by
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
    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s = budget_s  # 0: admission by budget is off (the engine's --max-waiting still applies)
        self.clock = clock
        self.pending: dict[str, float] = {}  # request id -> admitted at
        self._gaps: deque[float] = deque(maxlen=WINDOW_STARTS)  # busy time between consecutive starts
        self._prefills: deque[tuple[float, int]] = deque(maxlen=WINDOW_STARTS)  # (prefill seconds, prompt tokens)
        self._last_start = 0.0
        self._busy_since = math.inf

    @property
    def enabled(self) -> bool:
        return self.budget_s > 0

    def start_rate(self) -> float | None:
        """Requests starting per second while the server had pending requests (None: not measured yet)."""
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

    def estimate_wait(self, ahead: int | None = None) -> float:
        """Seconds a request arriving now would wait in the queue before it is scheduled (0: nothing pending)."""
        ahead = len(self.pending) if ahead is None else ahead
        if ahead == 0:
            return 0.0
        rate = self.start_rate()
        to_first_output = max(ahead / rate if rate else 0.0, self.oldest_wait())
        return max(0.0, to_first_output - self.typical_prefill_s())

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
        return self.budget_s + self.prefill_allowance_s(prompt_tokens)

    def admitted(self, rid: str) -> None:
        now = self.clock()
        if not self.pending:
            self._busy_since = now
        self.pending[rid] = now

    def started(self, rid: str, prompt_tokens: int, first_output: Any = None) -> None:
        """`first_output` (a RequestOutput) gives the engine's scheduling time, separating queue from prefill."""
        if self.pending.pop(rid, None) is None:
            return
        now = self.clock()
        self._gaps.append(now - max(self._last_start, self._busy_since))
        self._last_start = now
        scheduled = getattr(first_output, "first_scheduled_time", None)
        first_token = getattr(first_output, "first_token_time", None) or time.time()
        if isinstance(scheduled, (int, float)) and scheduled > 0:
            self._prefills.append((max(0.0, first_token - scheduled), prompt_tokens))
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

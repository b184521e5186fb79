"""cuDNN attention call shapes first met while the engine serves, after the start-up warm-up should have met them all.

Why: torch builds a cuDNN execution plan the first time a process calls its cuDNN attention with a new shape (sizes
and strides of q, k and v, causal or not, with or without log-sum-exps): 49-105 ms on an H200, 709 ms for the
process's first call (pdserve.ops.attention.library_prefill), spent on the host inside a step, so every request of
that step waits. The warm-up builds the common shapes; the rest (chunks shifted by decode rows, longer prefixes) are
built on first use. This counts and logs those, as pdserve.ops.jit_watch does for Triton's compiles, so a benchmark's
server log says whether any were built while it served.

One watcher per process (torch's plan cache is per process): `seen(key)` before a call, `record(key, seconds)` after
a first one (the call's host time: the plan is built on the host before the launch); `arm()` after the warm-up.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

MAX_LOGGED = 50  # shapes logged one by one; the count goes on


class PlanWatch:
    def __init__(self) -> None:
        self.armed = False
        self.built_after_arm = 0
        self.seconds_after_arm = 0.0
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    def seen(self, key: tuple) -> bool:
        return key in self._seen

    def record(self, key: tuple, seconds: float) -> None:
        """A call of a shape not met before took `seconds` of host time."""
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            if not self.armed:
                return
            self.built_after_arm += 1
            self.seconds_after_arm += seconds
            n = self.built_after_arm
        if n <= MAX_LOGGED:
            log.warning("built a cuDNN attention plan while serving (%.3f s; the warm-up did not meet this shape): %s",
                        seconds, describe(key))

    def arm(self) -> None:
        with self._lock:
            self.armed = True
            self.built_after_arm = 0
            self.seconds_after_arm = 0.0

    def stats(self) -> dict:
        return {"cudnn_plans_built_after_warmup": self.built_after_arm,
                "cudnn_plan_s_after_warmup": round(self.seconds_after_arm, 3)}


def describe(key: tuple) -> str:
    """A key made by library_prefill (q, k, v as (shape, strides), causal, lse, dtype) in words."""
    try:
        (qs, _), (ks, _), _, causal, lse, dtype = key
        return f"q {list(qs)} k {list(ks)}{' causal' if causal else ''}{' lse' if lse else ''} {dtype}"
    except (TypeError, ValueError):
        return repr(key)


WATCH = PlanWatch()  # this process's

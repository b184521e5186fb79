"""The engine's stats line in the server's log while it serves (vLLM's `Avg prompt throughput ...` line, every
`--log-stats-interval` seconds; `--disable-log-stats` or 0 turns it off):

    engine: prompt 8190.4 tokens/s, generation 9782.3 tokens/s; 59.1 steps/s, busy 99%, 16.8 ms a step, 88% of it
    waiting for the GPU; running 256, waiting 12; KV cache 45.2% used; prefix cache hit rate 0.0%

Rates are over the interval, from the engine's totals (EngineCore.totals): prompt tokens computed (prefix-cache hits
are not), tokens sampled, steps, the seconds the engine spent in its steps (busy: their share of the interval) and,
of those, the seconds it waited for launched steps' sampled tokens. That last share says who sets the pace: near
100% the GPU (the host prepares the next step while the GPU runs one), low the host. The hit rate is over the prompt
tokens looked up in the interval. Nothing is logged for an interval in which the engine computed nothing and held
no request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("pdserve.server.stats")

TOTALS = ("prompt_tokens_total", "generation_tokens_total", "num_steps", "step_s", "collect_wait_s",
          "prefix_cache_queries", "prefix_cache_hits")


class StatsLine:
    """Keeps the last snapshot's totals; `line(stats, now)` gives the interval's line since then (None: idle)."""

    def __init__(self, now: float, stats: dict | None = None):
        self.t = now
        self.last = {k: (stats or {}).get(k, 0) for k in TOTALS}

    def line(self, stats: dict, now: float) -> str | None:
        cur = {k: stats.get(k, 0) for k in TOTALS}
        d = {k: cur[k] - self.last[k] for k in TOTALS}
        dt = now - self.t
        self.t, self.last = now, cur
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        if dt <= 0 or (d["num_steps"] <= 0 and running == 0 and waiting == 0):
            return None
        steps, busy = d["num_steps"], d["step_s"]
        pace = "no steps"
        if steps > 0:
            pace = f"{steps / dt:.1f} steps/s"
            if busy > 0:  # an engine that reports its step times
                pace += (f", busy {min(1.0, busy / dt):.0%}, {1e3 * busy / steps:.1f} ms a step, "
                         f"{min(1.0, d['collect_wait_s'] / busy):.0%} of it waiting for the GPU")
        hit = f"{d['prefix_cache_hits'] / d['prefix_cache_queries']:.1%}" if d["prefix_cache_queries"] > 0 else "-"
        return (f"engine: prompt {d['prompt_tokens_total'] / dt:.1f} tokens/s, generation "
                f"{d['generation_tokens_total'] / dt:.1f} tokens/s; {pace}; running {running}, waiting {waiting}; "
                f"KV cache {stats.get('kv_usage', 0.0):.1%} used; prefix cache hit rate {hit}")


async def log_stats(stats: Callable[[], Awaitable[dict]], interval_s: float,
                    clock: Callable[[], float] = time.monotonic, emit: Callable[[str], None] = log.info) -> None:
    """Every `interval_s` seconds, the engine's stats line (`stats()`: the engine's last snapshot, as the server's
    engine_stats gives it) through `emit`; runs until cancelled. A snapshot that cannot be had skips its interval."""
    async def snapshot() -> dict | None:
        try:
            return await stats()
        except Exception:
            log.debug("engine stats unavailable for the stats line", exc_info=True)
            return None

    tracker = StatsLine(clock(), await snapshot())
    while True:
        await asyncio.sleep(interval_s)
        s = await snapshot()
        if s is None:
            continue
        text = tracker.line(s, clock())
        if text is not None:
            emit(text)

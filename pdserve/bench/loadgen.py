"""Load generation: send requests at gamma-distributed arrival times under an optional concurrency cap.

Arrivals follow vLLM 0.22's `bench serve`: inter-arrival gaps ~ Gamma(shape=burstiness,
scale=1/(rate*burstiness)) drawn in order from numpy's legacy generator seeded with --seed (burstiness 1 is a
Poisson process, larger is more regular, inf is exactly 1/rate), summed, and then rescaled so the last arrival
falls at num_prompts/rate: the arrival window of every seed is the same length. Rate inf sends everything at
once. Arrival times are absolute offsets from the start, so scheduling jitter does not accumulate. As in vLLM, a
request waiting for a concurrency slot has not started yet: its TTFT starts when it is actually sent, and the
wait is its client queue time.

A run stops early on a `StopSignal` (Ctrl-C, or a watcher such as the SLO search deciding a trial already
failed); requests then in flight are cancelled and recorded as failures of that kind, so whatever was
measured up to that point survives.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.client import RequestResult
from pdserve.bench.datasets import BenchRequest


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds of n arrivals, the last at n/rate (vLLM's schedule); all zero for an infinite rate."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * n
    else:
        rs = np.random.RandomState(seed)
        theta = 1.0 / (rate * burstiness)
        gaps = [float(rs.gamma(shape=burstiness, scale=theta)) for _ in range(n)]
    out, t = [], 0.0
    for g in gaps:
        t += g
        out.append(t)
    if out[-1] > 0:
        factor = (n / rate) / out[-1]
        out = [x * factor for x in out]
    return out


class StopSignal:
    """Asks a run to stop; the first reason given wins."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.event.set()

    @property
    def is_set(self) -> bool:
        return self.event.is_set()


@dataclass
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    max_duration_s: float | None = None  # no arrivals later than this
    drain_timeout_s: float | None = None  # after the last arrival, wait at most this long for requests in flight
    watch_interval_s: float = 0.2
    progress: bool = True
    request_id_prefix: str = ""  # request i is sent with the header x-request-id: <prefix><i> (none when empty)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")


@dataclass
class LoadResult:
    results: list[RequestResult]  # the requests actually sent, in order
    t0: float
    duration: float
    stop_reason: str | None
    num_planned: int


Sender = Callable[[BenchRequest, RequestResult], Awaitable[RequestResult]]
Watcher = Callable[[list[RequestResult], float], "str | None"]


async def run_load(
    items: Sequence[BenchRequest],
    send: Sender,
    cfg: LoadConfig,
    stop: StopSignal | None = None,
    watcher: Watcher | None = None,
) -> LoadResult:
    stop = stop or StopSignal()
    offsets = arrival_times(len(items), cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []
    pbar = _progress(len(items), cfg.progress)

    async def one(item: BenchRequest, res: RequestResult) -> None:
        try:
            req = await item.materialize()
            res.arrival = time.perf_counter()  # due now; a wait for a slot from here on is client queue time
            if sem is None:
                await send(req, res)
            else:
                async with sem:
                    await send(req, res)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a dataset error must not take the whole run down
            res.fail("client_error", f"{type(e).__name__}: {e}")
        finally:
            res.done = True
            item.complete(res.generated_text, res.success)
            if pbar is not None:
                pbar.update(1)

    async def watch() -> None:
        while True:
            await asyncio.sleep(cfg.watch_interval_s)
            reason = watcher(results, time.perf_counter())
            if reason:
                stop.set(reason)
                return

    watch_task = asyncio.create_task(watch()) if watcher else None
    t0 = time.perf_counter()
    try:
        for i, item in enumerate(items):
            if cfg.max_duration_s is not None and offsets[i] > cfg.max_duration_s:
                break
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.event.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if stop.is_set:
                break
            res = RequestResult(index=i, request_id=f"{cfg.request_id_prefix}{i}" if cfg.request_id_prefix else None)
            results.append(res)
            tasks.append(asyncio.create_task(one(item, res)))
        await _drain(tasks, stop, cfg.drain_timeout_s)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        if watch_task is not None:
            watch_task.cancel()
        if pbar is not None:
            pbar.close()
    end = time.perf_counter()
    kind = (stop.reason or "deadline").split(":")[0]
    sent = []
    for r in results:
        if not r.done or (not r.success and not r.error_kind):
            if not r.start:
                continue  # never left the client (waiting for a slot or an earlier round): not sent
            r.fail(kind, f"cancelled: {stop.reason or 'drain timeout after the last arrival'}")
        sent.append(r)
    reason = stop.reason or ("deadline" if len(results) < len(items) or len(sent) < len(results) else None)
    return LoadResult(results=sent, t0=t0, duration=max(end - t0, 1e-9), stop_reason=reason, num_planned=len(items))


async def _drain(tasks: list[asyncio.Task], stop: StopSignal, timeout_s: float | None) -> None:
    if not tasks:
        return
    all_done = asyncio.ensure_future(asyncio.wait(tasks))
    stopped = asyncio.ensure_future(stop.event.wait())
    try:
        await asyncio.wait({all_done, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (all_done, stopped):
            f.cancel()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # a bare image without tqdm still benchmarks, just without the bar
        return None

    return tqdm(total=total, unit="req", dynamic_ncols=True, leave=False)

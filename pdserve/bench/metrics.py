"""Benchmark metrics from per-request timings, with vLLM `bench serve`'s definitions and key names.

Pure functions over `RequestResult`s, so they are checked against hand-built timelines. Latency statistics
are over successful requests (as vLLM); failures are counted by kind. `percentile` interpolates linearly like
numpy's default but also accepts +inf samples (the search counts unfinished requests as infinitely late).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from pdserve.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method); inf-safe; nan for no samples."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    if not values:
        return math.nan
    v = sorted(values)
    pos = p / 100.0 * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    frac = pos - lo
    a, b = v[lo], v[hi]
    if frac == 0.0:
        return a
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return a + (b - a) * frac


def pct_name(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def request_tpot(r: RequestResult) -> float | None:
    """Seconds per output token after the first: (e2el - ttft) / (output_tokens - 1); None for 1-token outputs."""
    if r.output_tokens <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def per_request_values(results: list[RequestResult], metric: str) -> list[float]:
    """Samples of one metric in seconds over successful requests (ITL pools every gap of every request)."""
    ok = [r for r in results if r.success]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "e2el":
        return [r.latency for r in ok]
    if metric == "tpot":
        return [t for t in (request_tpot(r) for r in ok) if t is not None]
    if metric == "itl":
        return [x for r in ok for x in r.itl]
    raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else math.nan


def _std(v: list[float]) -> float:
    if not v:
        return math.nan
    m = _mean(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def meets_goodput(r: RequestResult, goodput_ms: dict[str, float]) -> bool:
    """A successful request counts toward goodput when its TTFT, TPOT and E2EL are each within their limit."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "e2el": r.latency, "tpot": request_tpot(r) or 0.0}
    return all(values[k] * 1000.0 <= limit for k, limit in goodput_ms.items())


def peak_output_throughput(results: list[RequestResult]) -> float:
    """Most output tokens in any one-second bucket since the first request started (vLLM's definition).

    A chunk's tokens are placed at its arrival time; chunks carrying several tokens are weighted by
    output_tokens / chunks of their request (vLLM counts chunks, which is the same for one token per chunk).
    """
    ok = [r for r in results if r.success and r.num_chunks > 0]
    if not ok:
        return 0.0
    t0 = min(r.start for r in ok)
    buckets: Counter[int] = Counter()
    for r in ok:
        weight = r.output_tokens / r.num_chunks if r.output_tokens else 1.0
        t = r.start + r.ttft
        buckets[int(t - t0)] += weight
        for gap in r.itl:
            t += gap
            buckets[int(t - t0)] += weight
    return float(max(buckets.values()))


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at one instant (exact, from start and end times of every sent request)."""
    events = []
    for r in results:
        if r.start and r.latency:
            events += [(r.start, 1), (r.start + r.latency, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end at the same instant as a start frees its slot first
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


@dataclass
class MetricOptions:
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput_ms: dict | None = None


def failure_reasons(results: list[RequestResult]) -> dict[str, dict]:
    """Failures grouped by kind, each with a count and the first message as an example."""
    out: dict[str, dict] = {}
    for r in results:
        if r.success:
            continue
        entry = out.setdefault(r.error_kind or "unknown", {"count": 0, "example": r.error})
        entry["count"] += 1
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, opts: MetricOptions | None = None) -> dict:
    """The summary dict, keyed as vLLM's result JSON (mean_ttft_ms, p99_tpot_ms, request_throughput, ...)."""
    opts = opts or MetricOptions()
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    in_tokens = sum(r.prompt_len if r.prompt_len >= 0 else (r.server_prompt_tokens or 0) for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    m: dict = {
        "duration": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failure_reasons": failure_reasons(results),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "max_output_tokens_per_s": peak_output_throughput(results),
        "max_concurrent_requests": peak_concurrency(results),
    }
    if opts.goodput_ms:
        m["request_goodput"] = sum(meets_goodput(r, opts.goodput_ms) for r in ok) / duration_s
    for metric in METRICS:
        vals = [x * 1000.0 for x in per_request_values(results, metric)]
        m[f"mean_{metric}_ms"] = _mean(vals)
        m[f"median_{metric}_ms"] = percentile(vals, 50.0)
        m[f"std_{metric}_ms"] = _std(vals)
        for p in sorted(set(opts.metric_percentiles) | {50.0, 90.0, 99.0}):
            m[f"p{pct_name(p)}_{metric}_ms"] = percentile(vals, p)
    return m


def request_samples(results: list[RequestResult], t0: float) -> list[dict]:
    """Every per-request sample for the JSON record; times in seconds, `start` relative to the run's start."""
    out = []
    for r in results:
        tpot = request_tpot(r) if r.success else None
        out.append(
            {
                "index": r.index,
                "success": r.success,
                "error_kind": r.error_kind or None,
                "error": r.error or None,
                "start": (r.start - t0) if r.start else None,
                "ttft": r.ttft if r.num_chunks else None,
                "tpot": tpot,
                "e2el": r.latency or None,
                "itl": r.itl,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "output_tokens": r.output_tokens,
                "server_prompt_tokens": r.server_prompt_tokens,
                "server_completion_tokens": r.server_completion_tokens,
                "chunks": r.num_chunks,
            }
        )
    return out

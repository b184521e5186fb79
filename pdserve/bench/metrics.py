"""Benchmark metrics from per-request timings, with vLLM 0.22 `bench serve`'s definitions and key names.

Pure functions over `RequestResult`s, so they are checked against hand-built timelines. As in vLLM:

- latency statistics are over successful requests; an empty sample set reports 0 (numpy over `values or 0`);
- TPOT per request is (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  ITL pools the gaps of every request;
- input tokens per request are the server's usage.prompt_tokens when given, else the dataset's prompt length;
- throughputs divide by the benchmark duration (start of the run to the end of the last request);
- goodput counts successful requests whose TTFT, TPOT (0 for one-token outputs) and E2EL are each within
  their limit, per second of duration;
- peak output throughput is the most timed events (tokens) in any one-second bucket after the earliest send
  of a successful request, and peak concurrency is exact over successful requests' [send, last event) intervals;
- mean, median, std (population) and percentiles (linear interpolation) as numpy computes them.

Failures are also counted by kind (pdserve's addition).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.bench.client import RequestResult
from pdserve.stats import mean, percentile, std

METRICS = ("ttft", "tpot", "itl", "e2el")
QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")
ALL_METRICS = METRICS + QUEUE_METRICS


def pct_name(p: float) -> str:
    """How vLLM spells a percentile in key names: 99 -> "99", 99.9 -> "99.9"."""
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
    if metric == "client_queue_time":
        return [r.queue_time for r in ok]
    if metric == "e2el_including_client_queue":
        return [r.latency + r.queue_time for r in ok]
    raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(ALL_METRICS)}")


def meets_goodput(r: RequestResult, goodput_ms: dict[str, float]) -> bool:
    """A successful request counts toward goodput when its TTFT, TPOT and E2EL are each within their limit."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "e2el": r.latency, "tpot": request_tpot(r) or 0.0}
    return all(values[k] <= limit / 1000.0 for k, limit in goodput_ms.items())


def token_times(r: RequestResult) -> list[float]:
    """Absolute arrival times of a request's timed events, rebuilt from its start, TTFT and ITLs (as vLLM)."""
    if not r.num_chunks and not r.itl:
        return []
    t = r.start + r.ttft
    out = [t]
    for gap in r.itl:
        t += gap
        out.append(t)
    return out


def peak_output_throughput(results: list[RequestResult]) -> float:
    """Most timed events in any one-second bucket counted from the earliest start of a successful request."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start for r in ok)
    buckets: Counter[int] = Counter(int(t - t0) for r in ok for t in token_times(r))
    return float(max(buckets.values())) if buckets else 0.0


def peak_concurrency(results: list[RequestResult]) -> int:
    """vLLM's "Peak concurrent requests": one-second buckets from the earliest start of a successful request; a
    request counts in every bucket from its start's to its end's (start + latency), both included; the fullest
    bucket. (A request that ends and the one that takes its slot can share a bucket, so a closed loop may show
    more than its concurrency, as vLLM's does.)"""
    ok = [r for r in results if r.success]
    if not ok:
        return 0
    t0 = min(r.start for r in ok)
    buckets: Counter[int] = Counter()
    for r in ok:
        for sec in range(int(r.start - t0), int(r.start + r.latency - t0) + 1):
            buckets[sec] += 1
    return max(buckets.values())


@dataclass
class MetricOptions:
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")  # what the console and vLLM's file report
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


def summary_stats(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std and the given percentiles, in ms, of samples in seconds; empty samples give 0 (vLLM)."""
    ms = [x * 1000.0 for x in values_s] or [0.0]
    out = {"mean": mean(ms), "median": percentile(ms, 50.0), "std": std(ms)}
    for p in percentiles:
        out[f"p{pct_name(p)}"] = percentile(ms, p)
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, opts: MetricOptions | None = None) -> dict:
    """The summary dict, keyed as vLLM's result JSON (mean_ttft_ms, p99_tpot_ms, request_throughput, ...).

    Every metric of METRICS gets mean, median, std and p50/p90/p99 plus the requested percentiles; the client
    queue metrics are added for the ones asked for in `percentile_metrics`.
    """
    opts = opts or MetricOptions()
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    in_tokens = sum(r.input_tokens for r in ok)
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
        "request_goodput": (sum(meets_goodput(r, opts.goodput_ms) for r in ok) / duration_s
                            if opts.goodput_ms else None),
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "max_output_tokens_per_s": peak_output_throughput(results),
        "max_concurrent_requests": peak_concurrency(results),
    }
    pcts = tuple(sorted(set(opts.metric_percentiles) | {50.0, 90.0, 99.0}))
    wanted = METRICS + tuple(x for x in QUEUE_METRICS if x in opts.percentile_metrics)
    for metric in wanted:
        for stat, value in summary_stats(per_request_values(results, metric), pcts).items():
            m[f"{stat}_{metric}_ms"] = value
    return m


def request_samples(results: list[RequestResult], t0: float) -> list[dict]:
    """Every per-request sample for the JSON record; times in seconds, `start` relative to the run's start."""
    out = []
    for r in results:
        tpot = request_tpot(r) if r.success else None
        out.append(
            {
                "index": r.index,
                "request_id": r.request_id,
                "success": r.success,
                "error_kind": r.error_kind or None,
                "error": r.error or None,
                "arrival": (r.arrival - t0) if r.arrival else None,
                "start": (r.start - t0) if r.start else None,
                "queue_time": r.queue_time,
                "ttft": r.ttft if r.num_chunks else None,
                "tpot": tpot,
                "e2el": r.latency or None,
                "itl": r.itl,
                "prompt_len": r.prompt_len,
                "input_tokens": r.input_tokens,
                "output_len": r.output_len,
                "output_tokens": r.output_tokens,
                "server_prompt_tokens": r.server_prompt_tokens,
                "server_completion_tokens": r.server_completion_tokens,
                "chunks": r.num_chunks,
            }
        )
    return out

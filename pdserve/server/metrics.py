"""Prometheus metrics of one instance, named `pdserve:*` in vLLM's style so existing dashboards translate.

Why a per-app CollectorRegistry: tests and a process holding several apps (router plus instances) must not
share one global registry. Engine-side numbers (running, waiting, KV usage, prefix cache) are read from
`llm.stats()` at scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920)


class _EngineStatsCollector(Collector):
    """Turns the last `llm.stats()` snapshot into gauges and counters at scrape time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self) -> Iterable[Metric]:
        s, labels = self.stats, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        yield gauge("num_requests_running", "Requests in the engine's running batch.", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.get("kv_usage", 0.0))
        yield gauge("kv_cache_free_blocks", "Free KV-cache blocks.", s.get("num_free_blocks", 0))
        yield gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.", s.get("num_total_blocks", 0))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge(
            "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.", hits / queries if queries else 0.0
        )
        yield counter("engine_steps", "Engine steps launched.", s.get("num_steps", 0))
        yield counter("engine_gpu_wait_seconds", "Seconds the engine waited for launched steps' sampled tokens (near "
                      "the wall time: the GPU sets the pace; well below it: the host does).", s.get("collect_wait_s", 0.0))
        transfers = (s.get("pd") or {}).get("transfers")
        if transfers is not None:  # a prefill or decode instance: KV handovers per transport and peer
            c = CounterMetricFamily(
                "pdserve:kv_transfers",
                "KV handovers by the transport that carried them and the peer agent (prefill: pushes to a decode "
                "agent; decode: arrivals from a prefill agent), by outcome (ok, failed).",
                labels=["model_name", "transport", "peer", "outcome"],
            )
            for t in transfers:
                c.add_metric([self.model_name, t["transport"], t["peer"], t["outcome"]], t["count"])
            yield c


class ServerMetrics:
    """All metrics of one instance; `track()` gives the per-request recorder the handlers feed."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # `*_created` series double the output and no pdserve dashboard reads them
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.requests = Counter(
            "pdserve:requests",
            "Finished requests by outcome (stop, length, abort, error, rejected, invalid, timeout).",
            ["model_name", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens.", labels, registry=r)
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Request arrival at the server to its first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Request arrival at the server to its last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "pdserve:request_queue_time_seconds",
            "Time a request waited in the engine before it was first scheduled.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._engine = _EngineStatsCollector(model_name)
        r.register(self._engine)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()

    def render(self, stats: dict) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)


class RequestTracker:
    """Timings of one request, recorded from the output deltas as they arrive."""

    def __init__(self, metrics: ServerMetrics, start: float | None = None):
        self.m = metrics
        # the request's arrival (time.perf_counter()): its body read and parsed, before it is tokenized, as vLLM's
        # renderer stamps arrival_time before it tokenizes; now when not given
        self.start = time.perf_counter() if start is None else start
        self.last: float | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self._queue_recorded = False

    def on_output(self, out: RequestOutput) -> None:
        t = time.perf_counter()
        label = self.m.model_name
        if out.num_prompt_tokens:
            self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        n = len(out.new_token_ids)
        if not self._queue_recorded and out.first_scheduled_time is not None and out.arrival_time:
            self.m.queue.labels(label).observe(max(0.0, out.first_scheduled_time - out.arrival_time))
            self._queue_recorded = True
        if n:
            if self.last is None:
                self.m.ttft.labels(label).observe(t - self.start)
                per_token, rest = 0.0, 0  # gaps between tokens that arrive together with the first are unknown
            else:
                per_token, rest = (t - self.last) / n, n
            for _ in range(rest):
                self.m.itl.labels(label).observe(per_token)
            self.last = t
            self.output_tokens += n

    def finish(self, outcome: str) -> None:
        label = self.m.model_name
        self.m.outcome(outcome)
        self.m.prompt_tokens.labels(label).inc(self.prompt_tokens)
        self.m.generation_tokens.labels(label).inc(self.output_tokens)
        if outcome in ("stop", "length"):
            self.m.e2e.labels(label).observe(time.perf_counter() - self.start)

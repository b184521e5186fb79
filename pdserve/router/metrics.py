"""Prometheus metrics of the router, per phase of a request and per instance.

Phases: router queue (admission wait, measured here), then prefill, handover (prefill done -> KV landed) and
decode first token, which the decode instance measures and reports in `pd_timings`; plus router-side TTFT and
end-to-end latency, outcomes, retries, local-prefill decisions and instance health. Each router owns its own
registry so several routers (tests) never collide on global metric names.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.config import KV_TRANSPORTS
from pdserve.router.pool import BreakerState, Instance

# 1 ms .. ~80 s, dense where handovers and TTFTs live
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
PHASES = ("queue_s", "prefill_s", "handover_s", "first_token_s", "push_start_s", "push_landed_s", "admit_s")
# the handover and its parts (prefill done -> push began -> notification taken -> admitted) exist only in pd mode
HANDOVER_PHASES = ("handover_s", "push_start_s", "push_landed_s", "admit_s")
# what pd_timings may name as the transport of a handover ("none": only the notification travelled)
HANDOVER_TRANSPORTS = frozenset(KV_TRANSPORTS) - {"auto"} | {"none"}


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.router_queue = Histogram("pdserve:router_queue_seconds", "Time a request waited for admission",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("pdserve:router_phase_seconds",
                               "Per-phase latency reported by the decode instance (pd_timings), by routing mode",
                               ["phase", "mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pdserve:router_time_to_first_token_seconds",
                              "Router arrival to the first content chunk sent to the client (streaming)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:router_e2e_request_latency_seconds", "Router arrival to last byte",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdserve:router_requests", "Requests by mode and outcome", ["mode", "outcome"],
                                registry=r)
        self.rejected = Counter("pdserve:router_rejected", "Requests refused at admission", ["reason"],
                                registry=r)
        self.decode_retries = Counter("pdserve:router_decode_retries",
                                      "Requests re-sent to another decode instance", registry=r)
        self.local_prefill = Counter("pdserve:router_local_prefill",
                                     "Requests prefilled on the decode instance, by reason", ["reason"], registry=r)
        self.prefill_fallback = Counter("pdserve:router_prefill_fallback",
                                        "Disaggregated requests whose decode instance fell back (pd_timings)",
                                        ["fallback"], registry=r)
        self.kv_transfers = Counter("pdserve:router_kv_transfers",
                                    "Disaggregated requests whose KV a prefill instance pushed, by the transport that "
                                    "carried it (pd_timings)", ["transport"], registry=r)
        self.queue_depth = Gauge("pdserve:router_queue_depth", "Requests waiting for admission", registry=r)
        self.inflight = Gauge("pdserve:router_inflight", "Requests outstanding per instance", ["url", "role"],
                              registry=r)
        self.healthy = Gauge("pdserve:router_instance_healthy", "1 if the instance's breaker is closed",
                             ["url", "role"], registry=r)
        self.breaker_state = Gauge("pdserve:router_instance_breaker_state",
                                   "Breaker state per instance (0 closed, 1 half-open, 2 open)", ["url", "role"],
                                   registry=r)
        self.load_tokens = Gauge("pdserve:router_instance_load_tokens",
                                 "Queued + running tokens per instance (last poll + dispatched since)",
                                 ["url", "role"], registry=r)

    def on_state(self, inst: Instance, old: BreakerState, new: BreakerState) -> None:
        code = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}[new]
        self.healthy.labels(inst.url, inst.role).set(1 if new is BreakerState.CLOSED else 0)
        self.breaker_state.labels(inst.url, inst.role).set(code)

    def observe_timings(self, timings: Any, mode: str) -> None:
        """Feed a `pd_timings` object into the phase histograms; ignores missing or malformed fields. A handover
        exists only in pd mode, and only there is a fallback a fallback."""
        if not isinstance(timings, dict):
            return
        for phase in PHASES:
            if phase in HANDOVER_PHASES and mode != "pd":
                continue
            value = timings.get(phase)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                self.phase.labels(phase.removesuffix("_s"), mode).observe(value)
        fallback = timings.get("fallback")
        if mode == "pd" and isinstance(fallback, str):
            self.prefill_fallback.labels(fallback).inc()
        transport = timings.get("transport")
        if mode == "pd" and isinstance(transport, str) and transport in HANDOVER_TRANSPORTS:
            self.kv_transfers.labels(transport).inc()

    def render(self, instances: list[Instance]) -> bytes:
        for inst in instances:  # gauges that are cheaper to sample at scrape time than to keep updated
            self.inflight.labels(inst.url, inst.role).set(inst.inflight)
            self.load_tokens.labels(inst.url, inst.role).set(inst.load_tokens)
            self.on_state(inst, inst.breaker.state, inst.breaker.state)
        return generate_latest(self.registry)

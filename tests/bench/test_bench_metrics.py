"""Metric arithmetic against hand-built request timelines (vLLM's definitions)."""

import math
import random

import numpy as np
import pytest

from pdserve.bench.client import RequestResult
from pdserve.bench.metrics import (
    MetricOptions,
    compute_metrics,
    peak_concurrency,
    peak_output_throughput,
    percentile,
    request_tpot,
)
from pdserve.bench.slo import certain_violation, judge, parse_slo


def ok(index, start, ttft, itl, out_tokens, prompt_len=10):
    r = RequestResult(index=index, prompt_len=prompt_len, output_len=out_tokens, success=True, done=True)
    r.start, r.ttft, r.itl = start, ttft, list(itl)
    r.first_token_time = start + ttft
    r.latency = ttft + sum(itl)
    r.num_chunks = 1 + len(itl)
    r.output_tokens = out_tokens
    return r


def failed(index, kind, start=1.0, latency=0.5):
    r = RequestResult(index=index, done=True)
    r.start, r.latency = start, latency
    r.fail(kind, f"{kind} happened")
    return r


def test_percentile_matches_numpy_and_handles_inf():
    rng = random.Random(1)
    for n in (1, 2, 5, 17, 100):
        vals = [rng.random() * 100 for _ in range(n)]
        for p in (0, 10, 50, 90, 99, 99.9, 100):
            assert percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)))
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    assert percentile([1.0, 2.0, math.inf], 90) == math.inf
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_timeline_metrics():
    a = ok(0, start=100.0, ttft=0.1, itl=[0.02, 0.03], out_tokens=3)
    b = ok(1, start=100.05, ttft=0.2, itl=[0.05], out_tokens=2, prompt_len=20)
    c = failed(2, "http_500", start=100.1, latency=0.01)
    duration = 0.5
    m = compute_metrics([a, b, c], duration, MetricOptions(metric_percentiles=(50.0, 99.0),
                                                          goodput_ms={"ttft": 150.0}))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["failure_reasons"] == {"http_500": {"count": 1, "example": "http_500 happened"}}
    assert m["total_input_tokens"] == 10 + 20
    assert m["total_output_tokens"] == 3 + 2
    assert m["request_throughput"] == pytest.approx(2 / duration)
    assert m["output_throughput"] == pytest.approx(5 / duration)
    assert m["total_token_throughput"] == pytest.approx(35 / duration)
    # TTFT over successful requests only
    assert m["mean_ttft_ms"] == pytest.approx((100 + 200) / 2)
    assert m["median_ttft_ms"] == pytest.approx(np.median([100, 200]))
    # TPOT per request excludes the first token: (e2el - ttft) / (tokens - 1)
    tpot_a, tpot_b = (0.05 / 2) * 1e3, (0.05 / 1) * 1e3
    assert request_tpot(a) * 1e3 == pytest.approx(tpot_a)
    assert m["mean_tpot_ms"] == pytest.approx((tpot_a + tpot_b) / 2)
    # ITL pools every gap of every request
    assert m["mean_itl_ms"] == pytest.approx(np.mean([20, 30, 50]))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([20, 30, 50], 99))
    assert m["mean_e2el_ms"] == pytest.approx((150 + 250) / 2)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200]))
    # goodput: only request a has TTFT <= 150 ms
    assert m["request_goodput"] == pytest.approx(1 / duration)
    # both requests overlap in time (the failed one too): 100.1 is inside a and b
    assert m["max_concurrent_requests"] == 3
    # all 5 tokens arrive within the first second after the first start
    assert m["max_output_tokens_per_s"] == 5


def test_one_token_outputs_have_no_tpot():
    r = ok(0, 0.0, 0.1, [], out_tokens=1)
    assert request_tpot(r) is None
    m = compute_metrics([r], 1.0)
    assert math.isnan(m["mean_tpot_ms"]) and m["mean_ttft_ms"] == pytest.approx(100)


def test_peak_concurrency_exact_and_peak_throughput_buckets():
    # three back-to-back requests never overlap (an end at the same instant as a start frees the slot)
    rs = [ok(i, start=float(i), ttft=0.5, itl=[0.5], out_tokens=2) for i in range(3)]
    assert peak_concurrency(rs) == 1
    rs.append(ok(3, start=0.25, ttft=0.125, itl=[0.125] * 9, out_tokens=10))  # binary-exact times
    assert peak_concurrency(rs) == 2
    # token arrival times: requests 0..2 at start + 0.5 and start + 1.0; request 3 at 0.375 + 0.125 k
    times = [i + d for i in range(3) for d in (0.5, 1.0)] + [0.375 + 0.125 * k for k in range(10)]
    per_second = [sum(1 for t in times if s <= t < s + 1) for s in range(4)]
    assert peak_output_throughput(rs) == max(per_second)


def test_multi_token_chunks_weighted_by_usage():
    r = ok(0, 0.0, 0.1, [0.1], out_tokens=8)  # 2 chunks carrying 8 tokens
    assert peak_output_throughput([r]) == 8


def test_compute_metrics_rejects_zero_duration():
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_slo_parse_and_judge_counts_failures_as_late():
    terms = parse_slo("p90_ttft_ms<=150, mean_tpot_ms<100")
    assert [str(t) for t in terms] == ["p90_ttft_ms<=150", "mean_tpot_ms<100"]
    good = [ok(i, float(i), 0.1, [0.01], 2) for i in range(10)]
    passed, vals, _ = judge(good, terms)
    assert passed and vals["p90_ttft_ms<=150"] == pytest.approx(100)
    # 2 failures out of 10 push the p90 to infinity: a server must not pass by dropping requests
    passed, vals, why = judge(good[:8] + [failed(8, "http_503"), failed(9, "http_503")], terms)
    assert not passed and vals["p90_ttft_ms<=150"] == math.inf and "p90_ttft_ms" in why
    for bad in ("p90_ttft<=5", "p90_foo_ms<=5", "p90_ttft_ms>=5", "", "p90_ttft_ms<=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_certain_violation_uses_lower_bounds_of_requests_in_flight():
    terms = parse_slo("p90_ttft_ms<=100")
    n_total = 20
    # p90 of 20 samples interpolates positions 17 and 18: 3 samples over the limit make it certain
    need = n_total - math.floor(0.9 * (n_total - 1))
    waiting = []
    for i in range(need):
        r = RequestResult(index=i, output_len=10)
        r.start = 10.0  # sent at t=10, no first token yet
        waiting.append(r)
    assert certain_violation(waiting[:-1], terms, n_total, now=10.5) is None
    assert certain_violation(waiting, terms, n_total, now=10.05) is None  # not late yet
    assert "early_stop" in certain_violation(waiting, terms, n_total, now=10.5)
    # TPOT lower bound: 1 s since the first token over at most 9 more tokens > 100 ms
    tp = parse_slo("p50_tpot_ms<=100")
    r = RequestResult(index=0, output_len=10)
    r.start, r.first_token_time = 1.0, 1.1
    assert certain_violation([r], tp, 1, now=1.1 + 0.5) is None
    assert certain_violation([r], tp, 1, now=1.1 + 1.0) is not None

"""Metric arithmetic against vLLM 0.22's definitions, written here independently with numpy, on built timelines."""

import math
import random

import numpy as np
import pytest

from pdserve.bench.client import RequestResult
from pdserve.bench.loadgen import arrival_times
from pdserve.bench.metrics import (
    MetricOptions,
    compute_metrics,
    meets_goodput,
    peak_concurrency,
    peak_output_throughput,
    request_tpot,
)
from pdserve.bench.slo import certain_violation, judge, parse_slo


def ok(index, start, ttft, itl, out_tokens, prompt_len=10, server_prompt=None):
    r = RequestResult(index=index, prompt_len=prompt_len, output_len=out_tokens, success=True, done=True)
    r.start, r.ttft, r.itl = start, ttft, list(itl)
    r.arrival = start
    r.first_token_time = start + ttft
    r.latency = ttft + sum(itl)
    r.num_chunks = 1 + len(itl)
    r.output_tokens = out_tokens
    r.server_prompt_tokens = server_prompt
    return r


def failed(index, kind, start=1.0, latency=0.5):
    r = RequestResult(index=index, prompt_len=7, done=True)
    r.start, r.latency = start, latency
    r.fail(kind, f"{kind} happened")
    return r


def vllm_reference(results, duration, pcts, goodput):
    """vLLM's calculate_metrics, restated: numpy over the successful requests, `or 0` for empty samples."""
    ttfts, tpots, all_tpots, itls, e2els, outs, ins = [], [], [], [], [], [], []
    for r in results:
        if not r.success:
            continue
        n = r.output_tokens
        outs.append(n)
        ins.append(r.server_prompt_tokens if r.server_prompt_tokens is not None else r.prompt_len)
        tpot = 0.0
        if n > 1:
            tpot = (r.latency - r.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += r.itl
        ttfts.append(r.ttft)
        e2els.append(r.latency)
    good = 0
    if goodput:
        cols, lims = [], []
        for key, vals in (("ttft", ttfts), ("tpot", all_tpots), ("e2el", e2els)):
            if key in goodput:
                cols.append(vals)
                lims.append(goodput[key] / 1000)
        good = sum(all(s >= v for s, v in zip(lims, row)) for row in zip(*cols))
    out = {"completed": len(ttfts), "failed": len(results) - len(ttfts), "total_input_tokens": sum(ins),
           "total_output_tokens": sum(outs), "request_throughput": len(ttfts) / duration,
           "output_throughput": sum(outs) / duration, "total_token_throughput": (sum(ins) + sum(outs)) / duration,
           "request_goodput": good / duration}
    for name, v in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out[f"mean_{name}_ms"] = np.mean(v or 0) * 1000
        out[f"median_{name}_ms"] = np.median(v or 0) * 1000
        out[f"std_{name}_ms"] = np.std(v or 0) * 1000
        for p in pcts:
            out[f"p{int(p) if int(p) == p else p}_{name}_ms"] = np.percentile(v or 0, p) * 1000
    return out


@pytest.mark.parametrize("seed", range(6))
def test_metrics_match_vllms_definitions_on_random_timelines(seed):
    rng = random.Random(seed)
    results = []
    for i in range(rng.randint(1, 40)):
        if rng.random() < 0.15:
            results.append(failed(i, rng.choice(["http_500", "timeout"]), start=rng.random()))
            continue
        n = rng.choice([1, 1, 2, 5, 17])
        chunks = rng.randint(1, n)  # several tokens may share a chunk
        results.append(ok(i, rng.random() * 5, rng.random(), [rng.random() * 0.1 for _ in range(chunks - 1)], n,
                          prompt_len=rng.randint(1, 100),
                          server_prompt=rng.choice([None, rng.randint(1, 100)])))
    duration, pcts = 3.7, (25.0, 50.0, 90.0, 99.0, 99.9)
    goodput = {"ttft": 600.0, "tpot": 40.0, "e2el": 900.0}
    m = compute_metrics(results, duration, MetricOptions(metric_percentiles=pcts, goodput_ms=goodput))
    ref = vllm_reference(results, duration, pcts, goodput)
    for key, want in ref.items():
        assert m[key] == pytest.approx(want, rel=1e-12, abs=1e-12), key


def test_empty_samples_report_zero_like_vllm():
    r = ok(0, 0.0, 0.1, [], out_tokens=1)
    m = compute_metrics([r, failed(1, "http_500")], 1.0)
    assert request_tpot(r) is None
    assert m["mean_tpot_ms"] == m["p99_tpot_ms"] == m["mean_itl_ms"] == 0.0 and m["mean_ttft_ms"] == pytest.approx(100)
    m = compute_metrics([failed(0, "http_500")], 1.0)
    assert m["completed"] == 0 and m["mean_e2el_ms"] == 0.0 and m["request_goodput"] is None


def test_goodput_limits_are_inclusive_and_one_token_outputs_have_tpot_zero():
    r = ok(0, 0.0, 0.25, [], out_tokens=1)
    assert meets_goodput(r, {"ttft": 250.0, "tpot": 0.0})
    assert not meets_goodput(r, {"ttft": 249.9})
    assert not meets_goodput(failed(1, "x"), {"ttft": 1e9})


def test_input_tokens_from_usage_when_the_server_reports_them():
    a = ok(0, 0.0, 0.1, [0.1], 2, prompt_len=10, server_prompt=11)  # e.g. a BOS the dataset did not count
    b = ok(1, 0.0, 0.1, [0.1], 2, prompt_len=20)
    assert compute_metrics([a, b], 1.0)["total_input_tokens"] == 11 + 20


def test_peak_concurrency_and_throughput_over_successful_requests():
    # vLLM's buckets: a request counts in every second from its start's to its end's, both included, so three
    # back-to-back requests of one second share a bucket pairwise
    rs = [ok(i, start=float(i), ttft=0.5, itl=[0.5], out_tokens=2) for i in range(3)]
    assert peak_concurrency(rs) == 2
    assert peak_concurrency([ok(i, start=float(i), ttft=0.25, itl=[0.5], out_tokens=2) for i in range(3)]) == 1
    rs.append(ok(3, start=0.25, ttft=0.125, itl=[0.125] * 9, out_tokens=10))  # binary-exact times: 0.25 .. 1.5
    assert peak_concurrency(rs) == 3
    assert peak_concurrency(rs + [failed(9, "x", start=0.3, latency=5.0)]) == 3  # failures do not count
    # one token per timed chunk, bucketed by whole seconds after the earliest successful start (vLLM)
    times = [i + d for i in range(3) for d in (0.5, 1.0)] + [0.375 + 0.125 * k for k in range(10)]
    per_second = [sum(1 for t in times if s <= t < s + 1) for s in range(4)]
    assert peak_output_throughput(rs) == max(per_second)
    assert peak_output_throughput([ok(0, 0.0, 0.1, [0.1], out_tokens=8)]) == 2  # chunks, not usage tokens


def test_compute_metrics_rejects_zero_duration():
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_queue_metrics_when_asked_for():
    a = ok(0, 2.0, 0.1, [0.1], 2)
    a.arrival = 1.5  # waited 0.5 s for a concurrency slot
    m = compute_metrics([a], 1.0, MetricOptions(percentile_metrics=("ttft", "client_queue_time",
                                                                     "e2el_including_client_queue")))
    assert m["mean_client_queue_time_ms"] == pytest.approx(500.0)
    assert m["p99_e2el_including_client_queue_ms"] == pytest.approx(700.0)
    assert "mean_client_queue_time_ms" not in compute_metrics([a], 1.0)


def vllm_arrivals(n, rate, burstiness, seed):
    """vLLM's get_request delays: sequential gammas from the global numpy generator, cumulated, rescaled."""
    np.random.seed(seed)
    delays = []
    for _ in range(n):
        delays.append(1.0 / rate if math.isinf(burstiness)
                      else np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
    for i in range(1, n):
        delays[i] += delays[i - 1]
    factor = (n / rate) / delays[-1]
    return [d * factor for d in delays]


@pytest.mark.parametrize("rate,burstiness,seed", [(50.0, 1.0, 0), (3.0, 0.5, 7), (10.0, 4.0, 1), (2.0, math.inf, 0)])
def test_arrivals_are_vllms_schedule(rate, burstiness, seed):
    got = arrival_times(200, rate, burstiness, seed)
    assert got == pytest.approx(vllm_arrivals(200, rate, burstiness, seed), rel=1e-12)
    assert got[-1] == pytest.approx(200 / rate)  # the window is num_prompts / rate whatever the draws


def test_arrival_process_shape():
    t = arrival_times(2000, rate=50.0, burstiness=1.0, seed=0)
    gaps = np.diff([0.0] + t)
    assert gaps.mean() == pytest.approx(1 / 50, rel=1e-9) and gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    gaps = np.diff(arrival_times(2000, rate=50.0, burstiness=100.0, seed=0))
    assert gaps.max() < 2 / 50  # nearly regular
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in ((0.0, 1.0), (1.0, 0.0), (math.nan, 1.0)):
        with pytest.raises(ValueError):
            arrival_times(3, *bad)


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

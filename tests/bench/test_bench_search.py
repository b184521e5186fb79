"""The SLO search: pure convergence on known thresholds, and a live search against a controllable endpoint."""

import asyncio
import math

import pytest

from pdserve.bench.client import EndpointConfig
from pdserve.bench.loadgen import LoadConfig, StopSignal, arrival_times
from pdserve.bench.runner import Bench, WorkloadConfig
from pdserve.bench.search import SearchConfig, Trial, search_max_rate, trial_size
from pdserve.bench.slo import parse_slo
from pdserve.bench.tokenizer import load_tokenizer
from pdserve.bench.trials import run_slo_search

from .fake_server import Behaviour, FakeServer


def _search(threshold: float, **kw) -> tuple:
    rates = []

    async def trial(rate, left):
        rates.append(rate)
        return Trial(rate=rate, passed=rate <= threshold)

    return asyncio.run(search_max_rate(trial, SearchConfig(**kw))), rates


@pytest.mark.parametrize("threshold", [0.3, 1.0, 3.7, 21.0, 100.0, 999.0])
def test_search_converges_within_one_bisection_step(threshold):
    res, rates = _search(threshold, start_rate=1.0, tolerance=0.1)
    assert res.stop_reason == "converged"
    assert res.max_rate <= threshold < res.min_failed_rate
    assert res.min_failed_rate - res.max_rate <= 0.1 * res.max_rate
    assert res.best_trial.rate == res.max_rate


def test_search_probes_exponentially_then_bisects():
    res, rates = _search(21.0, start_rate=1.0, growth=2.0, tolerance=0.1)
    assert rates[:6] == [1, 2, 4, 8, 16, 32]
    assert rates[6] == (16 + 32) / 2


def test_search_limits():
    res, _ = _search(5000.0, start_rate=1.0, max_rate=64.0)
    assert res.stop_reason == "max_rate_passed" and res.max_rate == 64.0
    res, _ = _search(0.001, start_rate=1.0, min_rate=0.1)
    assert res.stop_reason == "below_min_rate" and res.max_rate is None
    res, rates = _search(21.0, start_rate=1.0, max_trials=4)
    assert res.stop_reason == "max_trials" and len(rates) == 4

    async def interrupted(rate, left):
        return Trial(rate=rate, passed=None, reason="interrupted")

    res = asyncio.run(search_max_rate(interrupted, SearchConfig()))
    assert res.stop_reason == "interrupted" and res.max_rate is None


def test_trial_size():
    cfg = SearchConfig(requests_per_rate=5, min_requests=10, min_duration_s=4.0, max_requests=300)
    assert trial_size(1.0, cfg) == 10
    assert trial_size(3.0, cfg) == 15
    assert trial_size(10.0, cfg) == 50
    assert trial_size(100.0, cfg) == 300
    assert trial_size(2.5, SearchConfig(requests_per_rate=5, min_requests=1, min_duration_s=10.0)) == 25


def test_arrival_process():
    t = arrival_times(2000, rate=50.0, burstiness=1.0, seed=0)
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert mean == pytest.approx(1 / 50, rel=0.1) and cv == pytest.approx(1.0, rel=0.15)  # Poisson
    t = arrival_times(2000, rate=50.0, burstiness=100.0, seed=0)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert max(gaps) < 2 / 50  # nearly regular
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_live_search_finds_the_threshold_of_a_loaded_endpoint(word_tokenizer_dir):
    """The endpoint answers slowly once requests arrive faster than 22/s; the search must bracket 22/s.

    Bisecting [16, 32] with tolerance 0.2 ends at [20, 24]: the threshold sits ~10% from either end, well
    outside the endpoint's error in estimating the arrival rate from 16 nearly regular arrivals.
    """
    threshold = 22.0
    terms = parse_slo("p90_ttft_ms<=100")
    cfg = SearchConfig(start_rate=8.0, tolerance=0.2, requests_per_rate=2.0, min_requests=20, max_trials=12,
                       cooldown_s=0.5)

    async def go(url):
        record = {"runs": []}
        async with Bench(EndpointConfig(base_url=url, model="m"), load_tokenizer(str(word_tokenizer_dir)),
                         capacity_duration_s=0) as b:
            w = WorkloadConfig(random_input_len=8, random_output_len=2)
            section = await run_slo_search(b, w, LoadConfig(burstiness=1000.0, progress=False), terms, cfg,
                                           StopSignal(), record)
        return section, record

    behaviour = Behaviour(mode="rate_threshold", rate_threshold=threshold, slow_ttft_s=0.3, rate_window=16)
    with FakeServer(behaviour) as srv:
        section, record = asyncio.run(go(srv.url))
    assert section["stop_reason"] == "converged", section
    lo, hi = section["max_rate"], section["min_failed_rate"]
    assert lo <= threshold < hi and hi - lo <= cfg.tolerance * lo
    assert section["goodput"] > 0
    assert len(record["runs"]) == len(section["trials"])
    failing = [t for t in section["trials"] if t["passed"] is False]
    assert any("early_stop" in t["reason"] for t in failing)  # overloaded trials stop as soon as they must fail

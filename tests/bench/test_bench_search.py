"""The SLO search: pure convergence on known thresholds, and the seeds' benchmark (several input lengths in one
command) against a server whose latency grows with load, converging to rates computed from the server's model."""

import asyncio
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pdserve.bench.search import SearchConfig, Trial, search_max_rate, trial_size

from .fake_server import FakeServerProcess, Script

REPO = Path(__file__).resolve().parents[2]


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


# The seeds' benchmark against a loaded server. One FIFO prefill lane: a prompt of w words takes P = w * C
# seconds. A trial sends N requests at exactly 1/rate apart (--burstiness inf), so request i waits
# i * (P - 1/rate) when the lane cannot keep up and its TTFT is P + i * max(0, P - 1/rate): the p90 over N
# samples (numpy's interpolation, position 0.9 * (N - 1)) is P + 0.9 * (N - 1) * max(0, P - 1/rate), and the
# highest rate meeting p90 <= L is 1 / (P - (L - P) / (0.9 * (N - 1))).
# Timing noise only adds latency (a late first request shifts every TTFT of its trial), and on a shared 2-core
# machine it reached 95 ms; in one full run (session 29) two of a trial's 11 requests came more than 188 ms late, so
# the time scale is twice what it was then: the test checks the search against what was measured, and against the
# model only where noise cannot decide (a trial the model fails never passes; one at least NOISE under the limit
# passes). N = 6 requests a trial (it was 11): the model and every check hold for any N; the search still takes five
# trials a length, with passes and failures and both model checks along the way (asserted below), each trial about
# half as long (the test 39 s -> ~23 s on a 2-core CPU).
C, L, N = 0.0028, 0.6, 6
NOISE = 0.3
LENS = (80, 160)
SEARCH = dict(start_rate=16.0, growth=2.0, tolerance=0.25, min_rate=0.5, max_rate=400.0)


def model_p90(words: int, rate: float) -> float:
    p = words * C
    return p + 0.9 * (N - 1) * max(0.0, p - 1.0 / rate)


def model_max_rate(words: int) -> float:
    p = words * C
    return 1.0 / (p - (L - p) / (0.9 * (N - 1)))


def model_searches() -> list[list[tuple[float, bool, float]]]:
    """The trials the search must run against the model: (rate, passed, p90 - limit), each length starting at the
    previous length's result, as `pdserve bench search` does."""
    paths, start = [], SEARCH["start_rate"]
    for words in LENS:
        seq = []

        async def trial(rate, left, words=words, seq=seq):
            margin = model_p90(words, rate) - L
            seq.append((rate, margin <= 0, margin))
            return Trial(rate=rate, passed=margin <= 0)

        res = asyncio.run(search_max_rate(trial, SearchConfig(**{**SEARCH, "start_rate": start})))
        assert res.stop_reason == "converged" and res.max_rate <= model_max_rate(words) < res.min_failed_rate
        paths.append(seq)
        start = res.max_rate
    return paths


@pytest.mark.timeout(300)
def test_search_over_input_lengths_in_one_step_finds_each_lengths_max_rate(word_tokenizer_dir, tmp_path):
    expected = model_searches()  # without noise: both kinds of model check below come up along the way
    assert any(model_p90(w, r) <= L - NOISE for seq, w in zip(expected, LENS) for r, *_ in seq)
    assert any(model_p90(w, r) > L for seq, w in zip(expected, LENS) for r, *_ in seq)
    cmd = [sys.executable, "-m", "pdserve.bench", "search", "--tokenizer", str(word_tokenizer_dir),
           "--random-input-len", ",".join(map(str, LENS)), "--random-output-len", "2",
           "--slo", f"p90_ttft_ms<={L * 1000:g},p90_tpot_ms<=50", "--burstiness", "inf",
           "--start-rate", str(SEARCH["start_rate"]), "--growth", "2", "--tolerance", str(SEARCH["tolerance"]),
           "--min-rate", "0.5", "--max-rate", "400", "--min-requests", str(N), "--max-requests", str(N),
           "--requests-per-rate", "0", "--cooldown", "0.2", "--capacity-duration", "0", "--disable-tqdm",
           "--result-dir", str(tmp_path), "--result-filename", "seeds.json"]
    # the lane's clock in a process of its own: in a full run (session 38) the first trials came back with p90 'inf'
    # (requests past 600 ms where the lane allows 224 ms), never when run alone or beside CPU-bound processes; a
    # thread in the test process holding the interpreter lock (one long C call at a time) gives that same failure
    # with the server in a thread of the test process, and none with it here
    with FakeServerProcess(Script(mode="queue", prefill_s_per_token=C, itl_s=0.01)) as srv:
        p = subprocess.run([*cmd, "--base-url", srv.url], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads((tmp_path / "seeds.json").read_text())
    assert [s["input_len"] for s in rec["searches"]] == list(LENS)
    key = f"p90_ttft_ms<={L * 1000:g}"
    start = SEARCH["start_rate"]
    for s, words in zip(rec["searches"], LENS):
        trials = s["trials"]
        measured = [(t["rate"], t["passed"], t["values"].get(key), round(model_p90(words, t["rate"]) * 1e3, 1))
                    for t in trials]  # (rate, verdict, measured p90, the model's p90): shown if a check fails
        for t in trials:
            p90, model = float(t["values"][key]), model_p90(words, t["rate"]) * 1e3
            tpot = float(t["values"]["p90_tpot_ms<=50"])
            assert t["passed"] == (p90 <= L * 1000 and tpot <= 50), measured  # the verdict is the measurement's
            assert p90 >= 0.98 * model, measured  # nothing answers faster than the server's lane allows
            if model > L * 1000:
                assert not t["passed"], measured
            if model <= (L - NOISE) * 1000:
                assert t["passed"], measured
            run = rec["runs"][t["run_index"]]
            assert run["config"]["random_input_len"] == words and run["config"]["request_rate"] == t["rate"]
        # the search is search_max_rate's on these verdicts, starting at the previous length's result
        verdicts = {t["rate"]: t["passed"] for t in trials}

        async def replay(rate, left, verdicts=verdicts):
            return Trial(rate=rate, passed=verdicts[rate])

        res = asyncio.run(search_max_rate(replay, SearchConfig(**{**SEARCH, "start_rate": start})))
        assert [t.rate for t in res.trials] == [t["rate"] for t in trials], measured
        assert (s["max_rate"], s["min_failed_rate"], s["stop_reason"]) == (res.max_rate, res.min_failed_rate,
                                                                           "converged"), measured
        assert s["max_rate"] <= model_max_rate(words), measured  # the rate reported meets the SLO on the model
        start = s["max_rate"]
    # one table across lengths: CSV, markdown and the JSON's searches; and one plot across lengths
    rows = list(csv.DictReader((tmp_path / "seeds.csv").open()))
    assert [(int(r["input_len"]), float(r["max_rate"])) for r in rows] == [
        (s["input_len"], s["max_rate"]) for s in rec["searches"]]
    md = (tmp_path / "seeds.md").read_text()
    assert "| input len | output len | max rate (req/s) |" in md
    for s in rec["searches"]:
        assert f"| {s['input_len']} | 2 | {s['max_rate']:.2f} |" in md
    trials_csv = list(csv.DictReader((tmp_path / "seeds_trials.csv").open()))
    assert len(trials_csv) == sum(len(s["trials"]) for s in rec["searches"])
    for name in ("seeds_max_rate.png", "seeds_latency_vs_rate.png"):
        with Image.open(tmp_path / name) as im:
            assert im.format == "PNG" and im.size[0] > 500
    assert "max rate (req/s)" in p.stdout  # the table across lengths is printed too
    assert math.isfinite(rec["searches"][0]["goodput"])

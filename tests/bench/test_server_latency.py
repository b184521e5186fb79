"""server_latency.py: a run's latency means from two /metrics scrapes, vLLM's names and pdserve's own server."""

import importlib.util
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.engine.outputs import RequestOutput
from pdserve.server.metrics import RequestTracker, ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("server_latency", ROOT / "benchmarks/vs_vllm/server_latency.py")
sl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sl)


def _vllm_like():
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    h = {
        k: Histogram(name, "x", labels, registry=r)
        for name, k in sl.HISTOGRAMS.items()
        if name.startswith("vllm:")
    }
    return r, h


def test_means_over_the_difference_and_every_label_set():
    r, h = _vllm_like()
    h["itl"].labels("m", "0").observe(0.050)  # before the run: left out
    h["e2el"].labels("m", "0").observe(9.0)
    before = generate_latest(r).decode()
    for v in (0.004, 0.006):
        h["itl"].labels("m", "0").observe(v)
    h["itl"].labels("m", "1").observe(0.008)  # a second engine's label set counts too
    h["tpot"].labels("m", "0").observe(0.005)
    h["e2el"].labels("m", "0").observe(1.0)
    h["e2el"].labels("m", "1").observe(2.0)
    d = sl.run_latency(before, generate_latest(r).decode())
    assert d["itl"]["count"] == 3 and d["itl"]["mean_ms"] == pytest.approx(6.0)
    assert d["tpot"]["count"] == 1 and d["tpot"]["mean_ms"] == pytest.approx(5.0)
    assert d["e2el"]["mean_ms"] == pytest.approx(1500.0) and d["requests"] == 2
    assert "ttft" not in d  # no request's first token between the scrapes


@pytest.mark.parametrize("after", ["# a server without metrics\n", "404: Not Found", '{"detail":"Not Found"}',
                                   "<html><body>Not Found</body></html>"])
def test_no_histograms_no_means(after):
    """A server without the histograms, or a proxy answering /metrics with an error page: no means, no exception."""
    d = sl.run_latency("", after)
    assert d == {"requests": None}
    assert "none" in sl.line(d)


def _out(n_new: int, first: bool) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=list(range(n_new)), new_text="",
                         num_prompt_tokens=8 if first else 0)


def test_pdserve_server_itl_mean_is_the_request_tpot(tmp_path, monkeypatch):
    """pdserve's own histograms, fed as its handlers feed them: a chunk of several tokens spreads its gap over them,
    so the ITL mean over a request is (last token - first token) / (tokens - 1), the request's TPOT."""
    m = ServerMetrics("m")
    clock = iter([0.0, 0.100, 0.110, 0.130, 0.140, 0.140])  # start, first token, +1, +2 tokens, +1, finish
    monkeypatch.setattr("pdserve.server.metrics.time.perf_counter", lambda: next(clock))
    before = m.render({}).decode()
    t = RequestTracker(m)
    t.on_output(_out(1, True))
    t.on_output(_out(1, False))
    t.on_output(_out(2, False))
    t.on_output(_out(1, False))
    t.finish("length")
    after = m.render({}).decode()
    (tmp_path / "a.txt").write_text(before)
    (tmp_path / "b.txt").write_text(after)
    sl.main([str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "o.json")])
    d = json.loads((tmp_path / "o.json").read_text())
    assert d["itl"]["count"] == 4  # 5 tokens
    assert d["itl"]["mean_ms"] == pytest.approx((140 - 100) / 4)
    assert d["ttft"]["mean_ms"] == pytest.approx(100.0) and d["e2el"]["mean_ms"] == pytest.approx(140.0)
    assert d["requests"] == 1

"""benchmarks/vs_vllm/compare.py on made-up result files: vLLM and pdserve paired per workload, each server's two
clients paired, and alternating client rounds summarised as the ratio of means beside each client's own drift."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("vs_vllm_compare", ROOT / "benchmarks" / "vs_vllm" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(tok_s: float, ttft: float = 100.0, tpot: float = 10.0) -> dict:
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft, "p90_ttft_ms": ttft * 2, "mean_tpot_ms": tpot,
            "p90_tpot_ms": tpot, "mean_itl_ms": tpot, "mean_e2el_ms": 1000.0, "request_throughput": 1.0,
            "completed": 8, "failed": 0}


def test_servers_clients_and_rounds(tmp_path, compare):
    files = {
        "vllm_tp2_1024x1024_c256.json": _result(1000),
        "pdserve_tp2_1024x1024_c256.json": _result(800),
        "pdserve_tp2_1024x1024_c256_pdclient.json": _result(820),
        "pdserve_tp2_1024x1024_c256_r2.json": _result(900),
        "pdserve_tp2_1024x1024_c256_r2_pdclient.json": _result(880),
        "vllm_tp2_server.json": {"name": "vllm_tp2", "startup_s": 100.0, "kv_tokens": 1000},
        "pdserve_tp2_server.json": {"name": "pdserve_tp2", "startup_s": 20.0, "kv_tokens": 990},
    }
    for name, d in files.items():
        (tmp_path / name).write_text(json.dumps(d))
    c = compare.compare(tmp_path)
    (row,) = c["workloads"]
    assert row["mode"] == "tp2" and row["ratio"]["output_throughput"] == pytest.approx(0.8)  # round 1 only
    assert c["servers"][0]["ratio"]["kv_tokens"] == pytest.approx(0.99)
    (client,) = c["clients"]
    assert client["ratio"]["output_throughput"] == pytest.approx(820 / 800)
    (rounds,) = c["client_rounds"]
    m = rounds["metrics"]["output_throughput"]
    assert rounds["run"] == "pdserve_tp2_1024x1024_c256" and rounds["rounds"] == 2
    assert m["vllm_client"] == [800, 900] and m["pdserve_client"] == [820, 880]
    assert m["ratio_of_means"] == pytest.approx(850 / 850)
    assert m["drift_vllm_client"] == pytest.approx(900 / 800 - 1)
    text = compare.table(c)
    assert "ratio of means" in text and "800.00, 900.00" in text


def _streamed(tok_s: float, ttfts: list, itls: list, outs: list, **extra) -> dict:
    d = _result(tok_s) | {"ttfts": ttfts, "itls": itls, "output_lens": outs, "input_lens": [64] * len(outs)}
    d.pop("mean_e2el_ms")
    return d | extra


def test_stream_metrics(tmp_path, compare):
    # vLLM: two requests bunched at the start (3 and 2 tokens in the first chunk), one split into two SSE events 10 us
    # apart, and a failed request (no output) that is left out; the file has its own mean_e2el_ms.
    v = _streamed(1000, [0.100, 0.200, 0.0], [[0.002, 0.004, 0.006], [0.00001, 0.006, 0.008], []], [6, 5, 0],
                  mean_e2el_ms=999.0)
    # pdserve: one token a chunk (a last empty event 10 us after the last token), one request of a single token (no
    # gap); no mean_e2el_ms of its own, so the E2E ratio takes both engines' from the per-request lists.
    p = _streamed(800, [0.05, 0.05, 0.05], [[0.005, 0.005, 0.005, 0.00001], [0.005, 0.005], []], [4, 3, 1])
    (tmp_path / "vllm_single_64x6_c1.json").write_text(json.dumps(v))
    (tmp_path / "pdserve_single_64x6_c1.json").write_text(json.dumps(p))
    c = compare.compare(tmp_path)
    (row,) = c["workloads"]
    vs, ps = row["vllm"]["stream"], row["pdserve"]["stream"]
    assert vs["requests"] == 2 and ps["requests"] == 3
    assert vs["mean_e2el_ms"] == pytest.approx((112 + 214.01) / 2)
    assert vs["chunks_per_request"] == pytest.approx(4)
    assert vs["first_chunk_tokens"] == pytest.approx((3 + 2) / 2)
    assert vs["steady_gap_ms"] == pytest.approx((4 + 7) / 2)  # medians 4 and 7 ms (the 10 us gap left out)
    assert vs["tpot_steady_ms"] == pytest.approx((12 / 3 + 14.01 / 2) / 2)
    assert ps["mean_e2el_ms"] == pytest.approx((65.01 + 60 + 50) / 3)
    assert ps["chunks_per_request"] == pytest.approx((5 + 3 + 1) / 3)
    assert ps["first_chunk_tokens"] == pytest.approx(1)  # max(1, 4 - 4): the empty last event is no token
    assert ps["steady_gap_ms"] == pytest.approx(5)  # the single-token request has no gap
    assert ps["tpot_steady_ms"] == pytest.approx((15.01 / 3 + 10 / 2) / 2)
    assert row["vllm"]["mean_e2el_ms"] == 999.0 and row["pdserve"]["mean_e2el_ms"] is None
    q = row["ratio"]
    assert q["mean_e2el"] == pytest.approx(ps["mean_e2el_ms"] / vs["mean_e2el_ms"])
    assert q["steady_gap"] == pytest.approx(5 / 5.5)
    # the keys that were there before, unchanged
    assert set(q) >= {"output_throughput", "mean_ttft", "mean_tpot"}
    assert q["output_throughput"] == pytest.approx(0.8) and q["mean_tpot"] == pytest.approx(1.0)
    for k in compare.METRICS + ("completed", "failed", "file"):
        assert k in row["vllm"] and k in row["pdserve"]
    assert row["vllm"]["file"] == "vllm_single_64x6_c1.json" and row["vllm"]["mean_tpot_ms"] == 10.0
    text = compare.table(c)
    assert "| mean E2E vLLM / pdserve ms | steady gap vLLM / pdserve ms |" in text
    assert f"| 163.0 / {ps['mean_e2el_ms']:.1f} | 5.50 / 5.00 |" in text
    assert "| 1000.0 | 800.0 | 0.80 | 100.0 / 100.0 | 10.00 / 10.00 |" in text


def test_stream_metrics_missing(tmp_path, compare):
    # no per-request lists in either file (vLLM's --save-detailed off), or one of the lists missing: no stream, and
    # the E2E ratio from the files' own mean_e2el_ms
    (tmp_path / "vllm_single_64x6_c1.json").write_text(json.dumps(_result(1000)))
    partial = _streamed(800, [0.05], [[0.005]], [2]) | {"mean_e2el_ms": 1100.0}
    del partial["output_lens"]
    (tmp_path / "pdserve_single_64x6_c1.json").write_text(json.dumps(partial))
    c = compare.compare(tmp_path)
    (row,) = c["workloads"]
    assert row["vllm"]["stream"] is None and row["pdserve"]["stream"] is None
    assert row["ratio"]["mean_e2el"] == pytest.approx(1.1) and row["ratio"]["steady_gap"] is None
    assert row["ratio"]["output_throughput"] == pytest.approx(0.8)
    assert "| 1000.0 / 1100.0 | - / - |" in compare.table(c)
    # only failed requests, or none with a real gap
    assert compare.stream({"ttfts": [0.0], "itls": [[]], "output_lens": [0]}) is None
    s = compare.stream({"ttfts": [0.1], "itls": [[0.0001]], "output_lens": [2]})
    assert s["steady_gap_ms"] is None and s["tpot_steady_ms"] is None and s["first_chunk_tokens"] == 1
    assert s["chunks_per_request"] == 2 and s["mean_e2el_ms"] == pytest.approx(100.1)


def test_server_side_means_beside_the_client_files(tmp_path, compare):
    """A run's <file>.server.json (server_latency.py) rides along with its client file: the servers' own inter-token
    means get a ratio and a table of their own; a run without one has none."""
    files = {
        "vllm_single_32768x16_c1.json": _result(16.9, ttft=940.0, tpot=0.54),
        "pdserve_single_32768x16_c1.json": _result(16.6, ttft=884.0, tpot=5.31),
        "vllm_single_32768x16_c1.server.json": {"itl": {"mean_ms": 5.2, "count": 120}, "tpot": {"mean_ms": 5.2,
                                                                                             "count": 8},
                                                 "requests": 8},
        "pdserve_single_32768x16_c1.server.json": {"itl": {"mean_ms": 5.3, "count": 120}, "requests": 8},
        "vllm_single_8192x16_c1.json": _result(52.2),
        "pdserve_single_8192x16_c1.json": _result(55.3),
    }
    for name, d in files.items():
        (tmp_path / name).write_text(json.dumps(d))
    c = compare.compare(tmp_path)
    rows = {r["workload"]: r for r in c["workloads"]}
    assert len(rows) == 2  # the .server.json files are no runs of their own
    assert rows["32768x16_c1"]["ratio"]["server_itl"] == pytest.approx(5.3 / 5.2)
    assert rows["32768x16_c1"]["ratio"]["mean_tpot"] == pytest.approx(5.31 / 0.54)
    assert rows["8192x16_c1"]["ratio"]["server_itl"] is None and rows["8192x16_c1"]["vllm"]["server"] is None
    text = compare.table(c)
    assert "| single | 32768x16_c1 | - / - | 5.20 / 5.30 | 5.20 / - |" in text

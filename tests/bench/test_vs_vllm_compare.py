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

"""The commands end to end against a controllable endpoint: files written, Ctrl-C, plots, bad input."""

import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from pdserve.bench.capacity import capacity_warning, measure_capacity
from pdserve.bench.cli import main
from pdserve.bench.client import EndpointConfig

from .fake_server import Behaviour, FakeServer

REPO = Path(__file__).resolve().parents[2]


def _common(url, tokdir, *extra):
    return ["--base-url", url, "--tokenizer", str(tokdir), "--random-input-len", "8", "--random-output-len", "4",
            "--disable-tqdm", "--capacity-duration", "0", *extra]


def test_serve_writes_the_record(tmp_path, word_tokenizer_dir, capsys):
    with FakeServer(Behaviour(ttft_s=0.01, tpot_s=0.002)) as srv:
        rc = main(["serve", *_common(srv.url, word_tokenizer_dir), "--num-prompts", "12", "--request-rate", "100",
                   "--goodput", "ttft:1000", "tpot:1000", "--metric-percentiles", "50,90,99", "--save-result",
                   "--result-dir", str(tmp_path), "--result-filename", "run"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P90 TTFT (ms):" in out and "Request goodput (req/s):" in out
    rec = json.loads((tmp_path / "run.json").read_text())
    assert rec["kind"] == "serve" and rec["date"] and rec["command"] and "cpu_count" in rec["machine"]
    assert "git_commit" in rec and rec["args"]["num_prompts"] == 12
    run = rec["runs"][0]
    assert run["metrics"]["completed"] == 12 and run["metrics"]["request_goodput"] > 0
    assert len(run["requests"]) == 12 and all(len(s["itl"]) == 3 for s in run["requests"])
    assert all(s["prompt_len"] == 8 and s["output_tokens"] == 4 for s in run["requests"])
    rows = list(csv.DictReader((tmp_path / "run.csv").open()))
    assert len(rows) == 1 and rows[0]["completed"] == "12"
    assert "| run |" in (tmp_path / "run.md").read_text()


def test_ctrl_c_still_writes_what_was_measured(tmp_path, word_tokenizer_dir):
    with FakeServer(Behaviour(tpot_s=0.1)) as srv:
        cmd = [sys.executable, "-m", "pdserve.bench", "serve", *_common(srv.url, word_tokenizer_dir),
               "--num-prompts", "30", "--request-rate", "10", "--random-output-len", "100",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "partial"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.time() + 30
        while time.time() < deadline and srv.behaviour.count < 5:  # the run is under way
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Serving Benchmark Result" in out
    run = json.loads((tmp_path / "partial.json").read_text())["runs"][0]
    assert run["interrupted"] and 0 < run["num_sent"] < 30
    assert run["metrics"]["failure_reasons"]["interrupted"]["count"] == run["num_sent"]
    assert all(s["start"] is not None for s in run["requests"])


def test_search_writes_table_and_plots_that_open(tmp_path, word_tokenizer_dir, capsys):
    with FakeServer(Behaviour(ttft_s=0.005)) as srv:
        rc = main(["search", *_common(srv.url, word_tokenizer_dir), "--slo", "p90_ttft_ms<=500,p90_tpot_ms<=500",
                   "--start-rate", "8", "--max-rate", "32", "--min-requests", "8", "--requests-per-rate", "1",
                   "--cooldown", "0", "--result-dir", str(tmp_path), "--result-filename", "s"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "max rate 32" in out
    rec = json.loads((tmp_path / "s.json").read_text())
    (section,) = rec["searches"]
    assert section["max_rate"] == 32 and section["stop_reason"] == "max_rate_passed"
    assert [t["rate"] for t in section["trials"]] == [8, 16, 32] and section["goodput"] > 0
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [r["slo_passed"] for r in rows] == ["True"] * 3
    assert "max rate **32" in (tmp_path / "s.md").read_text()
    for name in ("s_latency_vs_rate.png", "s_throughput_vs_latency.png"):
        with Image.open(tmp_path / name) as im:
            im.verify()
        with Image.open(tmp_path / name) as im:
            assert im.format == "PNG" and im.size[0] > 500

    # two result files compared, e.g. colocated against disaggregated
    other = json.loads((tmp_path / "s.json").read_text())
    for run in other["runs"]:
        run["metrics"]["p90_ttft_ms"] *= 2
    (tmp_path / "b.json").write_text(json.dumps(other))
    rc = main(["compare", str(tmp_path / "s.json"), str(tmp_path / "b.json"), "--labels", "colocated,disagg",
               "--output", str(tmp_path / "cmp")])
    assert rc == 0
    with Image.open(tmp_path / "cmp_latency_vs_rate.png") as im:
        im.verify()
    md = (tmp_path / "cmp.md").read_text()
    assert "## colocated" in md and "## disagg" in md


def test_sweep_input_lengths_by_rates_into_one_file(tmp_path, word_tokenizer_dir):
    with FakeServer() as srv:
        rc = main(["sweep", *_common(srv.url, word_tokenizer_dir), "--input-lens", "4,16", "--request-rates",
                   "50,inf", "--num-prompts", "6", "--result-dir", str(tmp_path), "--result-filename", "sw"])
    assert rc == 0
    rec = json.loads((tmp_path / "sw.json").read_text())
    got = [(r["config"]["random_input_len"], r["config"]["request_rate"]) for r in rec["runs"]]
    assert got == [(4, 50.0), (4, "inf"), (16, 50.0), (16, "inf")]
    assert all(s["prompt_len"] == r["config"]["random_input_len"] for r in rec["runs"] for s in r["requests"])
    assert (tmp_path / "sw_latency_vs_rate.png").exists()


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["search", "--slo", "p90_ttft<=5"], "bad SLO term"),
        (["serve", "--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["serve", "--tokenizer", "/no/such/dir"], "not found"),
    ],
)
def test_bad_input_is_a_clear_error(argv, msg, word_tokenizer_dir, capsys):
    with FakeServer() as srv:
        rc = main([argv[0], "--base-url", srv.url, "--capacity-duration", "0", *argv[1:]])
    assert rc == 1 and msg in capsys.readouterr().err


def test_client_capacity_against_the_zero_work_endpoint():
    cap = asyncio.run(measure_capacity(EndpointConfig(base_url="http://unused"), output_len=16, concurrency=8,
                                       duration_s=0.5))
    assert cap["request_throughput"] > 50 and cap["output_throughput"] == pytest.approx(
        16 * cap["request_throughput"], rel=0.01)
    near = {"request_throughput": cap["request_throughput"] / 2, "output_throughput": 0.0}
    far = {"request_throughput": cap["request_throughput"] / 10, "output_throughput": cap["output_throughput"] / 10}
    assert "bottleneck" in capacity_warning(near, cap)
    assert capacity_warning(far, cap) is None


def test_sweep_with_a_search_per_input_length(tmp_path, word_tokenizer_dir):
    with FakeServer() as srv:
        rc = main(["sweep", *_common(srv.url, word_tokenizer_dir), "--input-lens", "4,12", "--slo",
                   "p90_ttft_ms<=1000", "--start-rate", "20", "--max-rate", "20", "--min-requests", "5",
                   "--requests-per-rate", "0.5", "--cooldown", "0", "--no-plots", "--result-dir", str(tmp_path),
                   "--result-filename", "ss"])
    assert rc == 0
    rec = json.loads((tmp_path / "ss.json").read_text())
    assert [(s["input_len"], s["max_rate"], s["stop_reason"]) for s in rec["searches"]] == [
        (4, 20.0, "max_rate_passed"), (12, 20.0, "max_rate_passed")]
    assert [r["config"]["random_input_len"] for r in rec["runs"]] == [4, 12]
    assert (tmp_path / "ss.md").read_text().count("max rate **20") == 2

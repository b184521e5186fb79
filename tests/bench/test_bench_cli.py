"""The commands end to end against the scripted endpoint: vLLM's result file and console block, pdserve's record,
output locations, Ctrl-C, search/compare/plot/sweep files, bad input."""

import asyncio
import csv
import json
import os
import re
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

from .fake_server import FakeServer, Script

REPO = Path(__file__).resolve().parents[2]


def _common(url, tokdir, *extra):
    return ["--base-url", url, "--tokenizer", str(tokdir), "--random-input-len", "8", "--random-output-len", "4",
            "--disable-tqdm", "--capacity-duration", "0", *extra]


def vllm_block(r: dict, pcts: list[str], metrics: list[tuple[str, str, str]], goodput: bool) -> str:
    """vLLM's console block restated from its format strings, filled from a result file's values."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             "{:<40} {:<10}".format("Successful requests:", r["completed"]),
             "{:<40} {:<10}".format("Failed requests:", r["failed"])]
    if r["max_concurrency"] is not None:
        lines.append("{:<40} {:<10}".format("Maximum request concurrency:", r["max_concurrency"]))
    if r["request_rate"] != "inf":
        lines.append("{:<40} {:<10.2f}".format("Request rate configured (RPS):", r["request_rate"]))
    lines += ["{:<40} {:<10.2f}".format("Benchmark duration (s):", r["duration"]),
              "{:<40} {:<10}".format("Total input tokens:", r["total_input_tokens"]),
              "{:<40} {:<10}".format("Total generated tokens:", r["total_output_tokens"]),
              "{:<40} {:<10.2f}".format("Request throughput (req/s):", r["request_throughput"])]
    if goodput:
        lines.append("{:<40} {:<10.2f}".format("Request goodput (req/s):", r["request_goodput"]))
    lines += ["{:<40} {:<10.2f}".format("Output token throughput (tok/s):", r["output_throughput"]),
              "{:<40} {:<10.2f}".format("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]),
              "{:<40} {:<10.2f}".format("Peak concurrent requests:", r["max_concurrent_requests"]),
              "{:<40} {:<10.2f}".format("Total token throughput (tok/s):", r["total_token_throughput"])]
    for key, name, header in metrics:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append("{:<40} {:<10.2f}".format(f"Mean {name} (ms):", r[f"mean_{key}_ms"]))
        lines.append("{:<40} {:<10.2f}".format(f"Median {name} (ms):", r[f"median_{key}_ms"]))
        for p in pcts:
            lines.append("{:<40} {:<10.2f}".format(f"P{p} {name} (ms):", r[f"p{p}_{key}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines) + "\n"


def test_serve_writes_vllms_result_file_and_pdserves_record(tmp_path, word_tokenizer_dir, capsys):
    argv = ["serve", *_common(None, word_tokenizer_dir), "--num-prompts", "12", "--request-rate", "50",
            "--max-concurrency", "3", "--goodput", "ttft:1000", "tpot:1000", "--metric-percentiles", "50,90",
            "--label", "mylabel", "--metadata", "tp=1", "note=a=b", "--save-result", "--result-dir", str(tmp_path)]
    with FakeServer(Script(ttft_s=0.01, itl_s=0.002, empty_chunks=(1,))) as srv:
        argv[2] = srv.url
        assert main(argv) == 0
        out1 = capsys.readouterr().out
        (path,) = [p for p in tmp_path.iterdir() if not p.name.endswith(".pdserve.json") and p.suffix == ".json"]
        # vLLM's name: {label}-{rate}qps-concurrency{N}-{model id}-{date}; the model id is /v1/models' root
        assert re.fullmatch(r"mylabel-50\.0qps-concurrency3-fake-root-\d{8}-\d{6}\.json", path.name), path.name
        assert main([*argv, "--append-result", "--save-detailed", "--result-filename", path.name,
                     "--percentile-metrics", "ttft,e2el,client_queue_time,e2el_including_client_queue"]) == 0
        out2 = capsys.readouterr().out
    first, second = [json.loads(line) for line in path.read_text().splitlines()]  # appended: one JSON a line
    assert list(first)[:13] == ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                                "num_prompts", "tp", "note", "request_rate", "burstiness", "max_concurrency",
                                "duration"]
    assert (first["backend"], first["label"], first["model_id"], first["tp"], first["note"]) == (
        "openai", "mylabel", "fake-root", "1", "a=b")
    assert first["tokenizer_id"] == str(word_tokenizer_dir) and first["date"] in path.name
    assert (first["request_rate"], first["burstiness"], first["max_concurrency"]) == (50.0, 1.0, 3)
    assert first["completed"] == 12 and first["failed"] == 0 and first["total_output_tokens"] == 48
    assert first["request_goodput"] == pytest.approx(first["request_throughput"])
    assert len(first["latencies"]) == len(first["queue_times"]) == 12
    assert not {"ttfts", "itls", "generated_texts", "errors", "input_lens", "output_lens"} & set(first)
    stats = {k for k in first if k.endswith("_ms")}
    assert stats == {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p90") for m in ("ttft", "tpot", "itl")}
    # --save-detailed keeps the per-request lists; queue metrics appear under a concurrency cap
    assert len(second["ttfts"]) == len(second["itls"]) == len(second["errors"]) == 12
    assert all(len(x) == 3 for x in second["itls"]) and second["generated_texts"][0].count("t") == 3
    assert {"mean_client_queue_time_ms", "p90_e2el_including_client_queue_ms", "p50_e2el_ms"} <= set(second)
    assert "mean_tpot_ms" not in second
    metrics = [("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
               ("itl", "ITL", "Inter-token Latency")]
    assert vllm_block(first, ["50", "90"], metrics, goodput=True) in out1
    metrics2 = [("ttft", "TTFT", "Time to First Token"), ("e2el", "E2EL", "End-to-end Latency"),
                ("client_queue_time", "Client Queue Time", "Client-side Queueing"),
                ("e2el_including_client_queue", "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency")]
    assert vllm_block(second, ["50", "90"], metrics2, goodput=True) in out2
    assert ("Traffic request rate: 50.0\nBurstiness factor: 1.0 (Poisson process)\n"
            "Maximum request concurrency: 3") in out1
    # pdserve's record beside it, gathering the appended run too
    rec = json.loads(Path(str(path)[:-5] + ".pdserve.json").read_text())
    assert rec["kind"] == "serve" and rec["command"] and "cpu_count" in rec["machine"] and len(rec["runs"]) == 2
    assert rec["runs"][0]["metrics"]["completed"] == 12 and len(rec["runs"][0]["requests"]) == 12
    assert all(s["request_id"] and s["output_tokens"] == 4 and len(s["itl"]) == 3 for s in rec["runs"][0]["requests"])
    assert len(list(csv.DictReader(Path(str(path)[:-5] + ".pdserve.csv").open()))) == 2


def test_serve_saves_nothing_without_save_result_and_exact_names_with_it(tmp_path, word_tokenizer_dir):
    with FakeServer() as srv:
        assert main(["serve", *_common(srv.url, word_tokenizer_dir), "--num-prompts", "3", "--result-dir",
                     str(tmp_path / "a")]) == 0
        assert main(["serve", *_common(srv.url, word_tokenizer_dir), "--num-prompts", "3", "--result-dir",
                     str(tmp_path / "b"), "--result-filename", "x.json", "--save-result", "--backend", "openai-chat",
                     "--model", "org/my-model", "--served-model-name", "fake-model"]) == 0
        bodies = [r.body for r in srv.records]
    assert not (tmp_path / "a").exists()  # as vLLM: files only with --save-result or --append-result
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["x.json", "x.pdserve.csv", "x.pdserve.json",
                                                                   "x.pdserve.md"]
    r = json.loads((tmp_path / "b" / "x.json").read_text())
    assert (r["backend"], r["model_id"], r["request_rate"], r["max_concurrency"]) == ("openai-chat", "org/my-model",
                                                                                     "inf", None)
    assert bodies[-1]["model"] == "fake-model" and "messages" in bodies[-1]  # the served name goes on the wire


def test_ctrl_c_still_writes_what_was_measured(tmp_path, word_tokenizer_dir):
    with FakeServer(Script(itl_s=0.1)) as srv:
        cmd = [sys.executable, "-m", "pdserve.bench", "serve", *_common(srv.url, word_tokenizer_dir),
               "--num-prompts", "30", "--request-rate", "10", "--random-output-len", "100",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "partial.json"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.time() + 30
        while time.time() < deadline and len(srv.records) < 6:  # the probe and some requests: the run is under way
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Serving Benchmark Result" in out
    run = json.loads((tmp_path / "partial.pdserve.json").read_text())["runs"][0]
    assert run["interrupted"] and 0 < run["num_sent"] < 30
    assert run["metrics"]["failure_reasons"]["interrupted"]["count"] == run["num_sent"]
    assert json.loads((tmp_path / "partial.json").read_text())["failed"] == run["num_sent"]


def test_search_compare_and_plot_write_under_result_dir(tmp_path, word_tokenizer_dir, capsys):
    with FakeServer(Script(ttft_s=0.005)) as srv:
        rc = main(["search", *_common(srv.url, word_tokenizer_dir), "--slo", "p90_ttft_ms<=500,p90_tpot_ms<=500",
                   "--start-rate", "8", "--max-rate", "32", "--min-requests", "8", "--requests-per-rate", "1",
                   "--cooldown", "0", "--max-requests", "8", "--result-dir", str(tmp_path), "--result-filename", "s"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "max rate 32" in out
    rec = json.loads((tmp_path / "s.json").read_text())
    (section,) = rec["searches"]
    assert section["max_rate"] == 32 and section["stop_reason"] == "max_rate_passed"
    assert [t["rate"] for t in section["trials"]] == [8, 16, 32] and section["goodput"] > 0
    rows = list(csv.DictReader((tmp_path / "s_trials.csv").open()))
    assert [r["slo_passed"] for r in rows] == ["True"] * 3
    assert [(r["input_len"], r["max_rate"]) for r in csv.DictReader((tmp_path / "s.csv").open())] == [("8", "32.0000")]
    assert "max rate **32" in (tmp_path / "s.md").read_text()
    for name in ("s_latency_vs_rate.png", "s_throughput_vs_latency.png", "s_max_rate.png"):
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
               "--result-dir", str(tmp_path / "cmp"), "--result-filename", "both.md"])
    assert rc == 0
    with Image.open(tmp_path / "cmp" / "both_latency_vs_rate.png") as im:
        im.verify()
    md = (tmp_path / "cmp" / "both.md").read_text()
    assert "## colocated" in md and "## disagg" in md
    assert main(["compare", str(tmp_path / "s.json"), "--output", str(tmp_path / "old")]) == 0  # older spelling
    assert (tmp_path / "old.md").exists()
    assert main(["plot", str(tmp_path / "s.json"), "--result-dir", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "s_max_rate.png").exists()


def test_sweep_input_lengths_by_rates_into_one_file(tmp_path, word_tokenizer_dir):
    with FakeServer() as srv:
        rc = main(["sweep", *_common(srv.url, word_tokenizer_dir), "--input-lens", "4,16", "--request-rates",
                   "50,inf", "--num-prompts", "6", "--result-dir", str(tmp_path), "--result-filename", "sw.json"])
    assert rc == 0
    rec = json.loads((tmp_path / "sw.json").read_text())
    got = [(r["config"]["random_input_len"], r["config"]["request_rate"]) for r in rec["runs"]]
    assert got == [(4, 50.0), (4, "inf"), (16, 50.0), (16, "inf")]
    assert all(s["prompt_len"] == r["config"]["random_input_len"] for r in rec["runs"] for s in r["requests"])
    assert (tmp_path / "sw_latency_vs_rate.png").exists()


def test_sweep_with_a_search_per_input_length(tmp_path, word_tokenizer_dir):
    with FakeServer() as srv:
        rc = main(["sweep", *_common(srv.url, word_tokenizer_dir), "--input-lens", "4,12", "--slo",
                   "p90_ttft_ms<=1000", "--start-rate", "20", "--max-rate", "20", "--min-requests", "5",
                   "--requests-per-rate", "0.5", "--cooldown", "0", "--no-plots", "--result-dir", str(tmp_path),
                   "--result-filename", "ss.json"])
    assert rc == 0
    rec = json.loads((tmp_path / "ss.json").read_text())
    assert [(s["input_len"], s["max_rate"], s["stop_reason"]) for s in rec["searches"]] == [
        (4, 20.0, "max_rate_passed"), (12, 20.0, "max_rate_passed")]
    assert [r["config"]["random_input_len"] for r in rec["runs"]] == [4, 12]
    assert (tmp_path / "ss.md").read_text().count("max rate **20") == 2


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["search", "--slo", "p90_ttft<=5"], "bad SLO term"),
        (["serve", "--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["serve", "--tokenizer", "/no/such/dir"], "not found"),
        (["serve", "--goodput", "ttft=5"], "--goodput"),
        (["serve", "--metadata", "novalue"], "KEY=VALUE"),
        (["serve", "--backend", "openai-chat", "--endpoint", "/v1/completions"], "openai-chat"),
        (["serve", "--percentile-metrics", "ttft,foo"], "unknown"),
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


def test_environment_proxy_is_honoured_unless_no_trust_env(tmp_path, word_tokenizer_dir, monkeypatch, capsys):
    """By default (aiohttp's trust_env, as vLLM's client has it) HTTP_PROXY from the environment is honoured; with
    --no-trust-env it is ignored.
    The base URL is a closed port: only a request that went through the proxy (the fake server) can succeed."""
    for var in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    closed = "http://127.0.0.1:9"  # discard: nothing listens there in a test environment
    argv = ["serve", *_common(closed, word_tokenizer_dir), "--model", "fake", "--num-prompts", "3",
            "--max-concurrency", "2", "--skip-initial-test", "--save-result", "--result-dir", str(tmp_path)]
    with FakeServer(Script(ttft_s=0.005, itl_s=0.001)) as srv:
        monkeypatch.setenv("HTTP_PROXY", srv.url)
        monkeypatch.setenv("http_proxy", srv.url)
        assert main([*argv, "--result-filename", "proxied.json"]) == 0
        assert len(srv.records) == 3
        assert main([*argv, "--no-trust-env", "--result-filename", "direct.json"]) == 0
        assert len(srv.records) == 3  # nothing more reached the proxy
    capsys.readouterr()
    assert json.loads((tmp_path / "proxied.json").read_text())["completed"] == 3
    assert json.loads((tmp_path / "direct.json").read_text())["completed"] == 0

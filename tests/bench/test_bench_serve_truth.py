"""`pdserve bench serve` against a scripted server: console and vLLM result file agree with the truth within 1%.

The truth is computed from what the server recorded (when each chunk actually left) and when the client sent each
request (the start times vLLM's detailed result file carries, on the same perf_counter clock as the server's),
with vLLM's definitions applied independently here with numpy: TTFT to the first chunk with choices (also an empty
one), E2EL to the last such chunk (the trailing usage chunk comes later on purpose), ITL between them, TPOT from
the usage token count or, without usage, the tokenizer's count of the text. The benchmark runs in a subprocess,
so client and server do not share an interpreter.

This machine is shared: a client or server descheduled for a few milliseconds moves single samples by as much.
Were all gaps alike, that noise would decide which samples sit at the p90 and p99 and move those by its own
tail; so the script makes every TTFT and every gap different, milliseconds apart, and hundreds of
milliseconds long: a percentile then moves only by the noise of the one or two samples it sits on. A run whose
comparison still fails is repeated (at most 3 runs): a real error fails every run.
"""

from __future__ import annotations

import gc
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .fake_server import FakeServer, Script, prompt_tokens

REPO = Path(__file__).resolve().parents[2]
PREFIX = "truth-"
PCTS = (50.0, 90.0, 99.0)
CONSOLE = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def vllm_arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """vLLM 0.22's arrival offsets, written independently: sequential gamma draws from the global numpy generator
    seeded with --seed, summed, rescaled so the last one is at n / rate."""
    np.random.seed(seed)
    theta = 1.0 / (rate * burstiness)
    delays = np.cumsum([np.random.gamma(shape=burstiness, scale=theta) for _ in range(n)])
    return list(delays * (n / rate) / delays[-1])


def run_bench(srv: FakeServer, tokdir: Path, out: Path, n: int, in_len: int, out_len: int, *extra: str):
    cmd = [sys.executable, "-m", "pdserve.bench", "serve", "--base-url", srv.url, "--tokenizer", str(tokdir),
           "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--num-prompts", str(n),
           "--disable-tqdm", "--capacity-duration", "0", "--request-id-prefix", PREFIX,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
           "--save-detailed", "--result-dir", str(out), "--result-filename", "run.json", *extra]
    srv.records.clear()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, json.loads((out / "run.json").read_text())


def console_values(stdout: str) -> dict[str, float]:
    """The "label: value" lines of the Serving Benchmark Result block."""
    block = stdout[stdout.index(" Serving Benchmark Result "):]
    block = block[: block.index("=" * 50, 60)]
    out = {}
    for line in block.splitlines():
        m = re.match(r"^(.+?):\s+(-?[0-9.]+)\s*$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def vllm_peak_concurrency(result: dict) -> int:
    """vLLM's formula over the file's per-request times (serve.py: per-second buckets from the first start; each
    successful request counts from its start's bucket to its end's, both included)."""
    ok = [(s, lat) for s, lat, e in zip(result["start_times"], result["latencies"], result["errors"]) if not e]
    t0 = min(s for s, _ in ok)
    counts = np.zeros(int(np.ceil(max(s + lat for s, lat in ok) - t0)) + 1)
    for s, lat in ok:
        counts[int(s - t0): int(s + lat - t0) + 1] += 1
    return int(counts.max())


def truth_of(srv: FakeServer, result: dict, n: int, usage: bool, t0: float) -> dict:
    recs = srv.bench_records(PREFIX)
    assert sorted(recs) == list(range(n)), "every request reached the server once, under its request id"
    starts = result["start_times"]
    ttft, e2el, itl, tpot, outs, ins = [], [], [], [], [], []
    for i in range(n):
        r = recs[i]
        assert starts[i] <= r.arrival < starts[i] + 1.0  # the client's send times are real
        if r.status != 200:
            continue
        c = r.chunk_times
        ttft.append(c[0] - starts[i])
        e2el.append(c[-1] - starts[i])
        itl += [b - a for a, b in zip(c, c[1:])]
        tokens = r.tokens if usage else sum(len(t.split()) for t in r.chunk_texts)
        outs.append(tokens)
        if tokens > 1:
            tpot.append((e2el[-1] - ttft[-1]) / (tokens - 1))
        ins.append(prompt_tokens(r.prompt_words) if usage else r.prompt_words)
    duration = max(r.end for r in recs.values()) - t0
    t = {"completed": len(ttft), "failed": n - len(ttft), "total_input_tokens": sum(ins),
         "total_output_tokens": sum(outs), "duration": duration, "request_throughput": len(ttft) / duration,
         "output_throughput": sum(outs) / duration, "total_token_throughput": (sum(ins) + sum(outs)) / duration}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = np.array(v) * 1000.0
        t[f"mean_{name}_ms"] = float(np.mean(ms))
        for p in PCTS:
            t[f"p{int(p)}_{name}_ms"] = float(np.percentile(ms, p))
        t[f"median_{name}_ms"] = float(np.median(ms))
    return t


def compare(truth: dict, result: dict, stdout: str) -> list[str]:
    """Every disagreement beyond 1% (console values are printed with 2 decimals: half a unit more)."""
    bad = []
    shown = console_values(stdout)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
        if result[key] != truth[key]:
            bad.append(f"{key}: file {result[key]} != truth {truth[key]}")
    checks = [(k, k) for k in ("request_throughput", "output_throughput", "total_token_throughput", "duration")]
    for name in CONSOLE:
        checks += [(f"{s}_{name}_ms", f"{s}_{name}_ms") for s in ("mean", "median", "p90", "p99")]
    for file_key, truth_key in checks:
        if not math.isclose(result[file_key], truth[truth_key], rel_tol=0.01):
            bad.append(f"{file_key}: file {result[file_key]:.3f} vs truth {truth[truth_key]:.3f}")
    labels = {"Successful requests": "completed", "Failed requests": "failed",
              "Total input tokens": "total_input_tokens", "Total generated tokens": "total_output_tokens",
              "Request throughput (req/s)": "request_throughput", "Benchmark duration (s)": "duration",
              "Output token throughput (tok/s)": "output_throughput",
              "Total token throughput (tok/s)": "total_token_throughput"}
    for name, label in CONSOLE.items():
        labels |= {f"Mean {label} (ms)": f"mean_{name}_ms", f"Median {label} (ms)": f"median_{name}_ms",
                   f"P90 {label} (ms)": f"p90_{name}_ms", f"P99 {label} (ms)": f"p99_{name}_ms"}
    for label, key in labels.items():
        if label not in shown:
            bad.append(f"console lacks {label!r}")
        elif not abs(shown[label] - truth[key]) <= 0.01 * abs(truth[key]) + 0.005:
            bad.append(f"console {label} {shown[label]} vs truth {truth[key]:.3f}")
    return bad


def attempts(check, tries: int = 3) -> None:
    failures = []
    for _ in range(tries):
        bad = check()
        if not bad:
            return
        print("run disagreed with the truth (repeating):", "; ".join(bad))
        failures.append(bad)
    pytest.fail(f"{tries} runs disagreed with the truth: " + " | ".join("; ".join(b) for b in failures))


@pytest.fixture
def frozen_gc():
    """No collection of the test process's large heap while the server thread is timing chunks."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.timeout(300)
def test_closed_loop_with_trailing_usage_empty_chunks_and_http_500s(word_tokenizer_dir, tmp_path, frozen_gc):
    """Concurrency 5, 20 requests, completions: the first and fourth chunk of every answer have empty text, the usage
    chunk follows the last token by 150 ms, every 10th request answers HTTP 500."""
    n, in_len, out_len, conc = 20, 12, 5, 5
    script = Script(ttft_s=0.3, ttft_step_s=0.015, itl_s=0.1, itl_step_s=0.002, usage=True, usage_delay_s=0.15,
                    empty_chunks=(0, 3), fail_every=10)
    with FakeServer(script) as srv:

        def check() -> list[str]:
            stdout, result = run_bench(srv, word_tokenizer_dir, tmp_path, n, in_len, out_len,
                                       "--max-concurrency", str(conc))
            t0 = min(result["start_times"])  # a closed loop sends its first requests as it starts
            truth = truth_of(srv, result, n, usage=True, t0=t0)
            assert truth["failed"] == 2 and truth["total_output_tokens"] == 18 * out_len
            assert truth["total_input_tokens"] == 18 * (in_len + 1)  # usage.prompt_tokens, not the dataset's 12
            bad = compare(truth, result, stdout)
            shown = console_values(stdout)["Maximum request concurrency"]
            peak = vllm_peak_concurrency(result)
            if result["max_concurrent_requests"] != peak or shown != conc or not conc <= peak <= 2 * conc:
                bad.append(f"peak concurrency {result['max_concurrent_requests']} != vLLM's {peak} (limit {conc})")
            return bad

        attempts(check)


@pytest.mark.timeout(300)
def test_poisson_chat_without_usage_counts_tokens_with_the_tokenizer(word_tokenizer_dir, tmp_path, frozen_gc):
    """Poisson arrivals at 5 req/s (vLLM's rescaled schedule), chat endpoint, no usage chunk: output tokens are the
    tokenizer's count of the text (the empty second chunk adds none) and input tokens the dataset's."""
    n, in_len, out_len, rate, seed = 16, 10, 5, 5.0, 3
    script = Script(ttft_s=0.3, ttft_step_s=0.015, itl_s=0.1, itl_step_s=0.002, usage=False, empty_chunks=(1,))
    offsets = vllm_arrivals(n, rate, 1.0, seed)
    np.random.seed(seed)
    unscaled = sum(np.random.gamma(1.0, 1.0 / rate) for _ in range(n))
    assert abs(unscaled - offsets[-1]) > 0.3  # this seed's draws span 2.5 s: only vLLM's rescaling gives n / rate
    with FakeServer(script) as srv:

        def check() -> list[str]:
            stdout, result = run_bench(srv, word_tokenizer_dir, tmp_path, n, in_len, out_len, "--backend",
                                       "openai-chat", "--request-rate", str(rate), "--seed", str(seed))
            starts = result["start_times"]
            t0 = starts[0] - offsets[0]  # the run began one first gap before the first send
            bad = [f"request {i} sent {1e3 * (s - t0):.1f} ms after the start, not {1e3 * off:.1f}"
                   for i, (s, off) in enumerate(zip(starts, offsets)) if abs(s - t0 - off) > 0.05]
            truth = truth_of(srv, result, n, usage=False, t0=t0)
            assert truth["total_output_tokens"] == n * (out_len - 1) and truth["total_input_tokens"] == n * in_len
            if console_values(stdout)["Request rate configured (RPS)"] != rate:
                bad.append("the console does not show the configured rate")
            return bad + compare(truth, result, stdout)

        attempts(check)
        assert all(r.body["max_completion_tokens"] == out_len and "messages" in r.body
                   for r in srv.bench_records(PREFIX).values())

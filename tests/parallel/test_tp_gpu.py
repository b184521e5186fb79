"""TP=2 on two GPUs (NCCL) against TP=1, CUDA graphs on (full decode graphs and piecewise mixed graphs, their
all-reduces captured on every rank): fp32 logits within GPU_TOL at every sampled position and the same greedy
tokens — a different token is accepted only where TP=1's own logits call it a tie within GPU_TOL, and that request
is compared no further. Each engine runs in a fresh process (tests/parallel/tp_run.py), as an instance's does.
A rank killed mid-decode fails the engine within seconds with an error naming it."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

ROOT = Path(__file__).resolve().parents[2]
GPU_TOL = dict(atol=2e-3, rtol=1e-3)  # fp32 GEMMs of other shapes (a rank's half) round differently on the GPU
DETECT_S = 30.0


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.parallel.tp_run", *args]


def _run(cfg: dict, out: Path) -> dict:
    p = subprocess.run(_cmd("run", json.dumps(cfg), str(out)), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return torch.load(out)


def _compare(ref: dict, got: dict) -> int:
    """The number of requests whose tokens all match (the rest ended at a tie)."""
    exact = 0
    assert ref["tokens"].keys() == got["tokens"].keys()
    for rid, ref_tokens in ref["tokens"].items():
        tokens, rows, ref_rows = got["tokens"][rid], got["logits"][rid], ref["logits"][rid]
        for i, ((n, x), (m, y)) in enumerate(zip(rows, ref_rows)):
            assert n == m, f"{rid}: sampled positions differ"
            torch.testing.assert_close(x, y, **GPU_TOL, msg=f"{rid} at {n}")
            if tokens[i] != ref_tokens[i]:
                gap = float(y.max() - y[tokens[i]])
                assert gap <= GPU_TOL["atol"], f"{rid} token {i}: {tokens[i]} vs {ref_tokens[i]}, not a tie ({gap})"
                break
        else:
            assert tokens == ref_tokens
            exact += 1
    return exact


def _assert_graphs_ran(res: dict) -> None:
    counts = res["step_counts"]
    assert all(c == counts[0] for c in counts), counts  # every rank ran every step the same way
    assert counts[0]["decode_graph"] > 0 and counts[0]["mixed_graph"] > 0, counts
    assert counts[0]["eager"] == 0, counts


# warmup=False: the start-up warm-up (17 s a run on an H200) is not what these tests are about
DUMMY = dict(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="float32", num_gpu_blocks=512,
             max_num_batched_tokens=96, max_num_seqs=8, max_model_len=2048, warmup=False)


@pytest.fixture(scope="module")
def dummy_tp1(tmp_path_factory) -> dict:
    """TP=1's run of the dummy model, shared by the NCCL and symmetric-memory comparisons (one engine start less)."""
    return _run(dict(DUMMY, tensor_parallel_size=1), tmp_path_factory.mktemp("tp1") / "tp1.pt")


def test_dummy_qwen3_tp2_matches_tp1_with_graphs(dummy_tp1, tmp_path):
    ref = dummy_tp1
    got = _run(dict(DUMMY, tensor_parallel_size=2), tmp_path / "tp2.pt")
    _assert_graphs_ran(got)
    assert [p["kv_heads"] for p in got["pools"]] == [(0, 4), (4, 8)]
    assert [p["device"] for p in got["pools"]] == ["cuda:0", "cuda:1"]
    assert _compare(ref, got) >= len(ref["tokens"]) - 1


def test_dummy_qwen3_tp2_symm_mem_sums_match_tp1_with_graphs(dummy_tp1, tmp_path):
    """--tp-all-reduce symm_mem: the decode and mixed steps' sums go through symmetric memory, inside the graphs."""
    ref = dummy_tp1
    got = _run(dict(DUMMY, tensor_parallel_size=2, tp_all_reduce="symm_mem"), tmp_path / "tp2.pt")
    _assert_graphs_ran(got)
    assert all(n > 0 for n in got["fast_sums"]), got["fast_sums"]
    assert _compare(ref, got) >= len(ref["tokens"]) - 1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_tiny_models_tp2_match_tp1_with_graphs(arch, tiny_model_dirs, tmp_path):
    cfg = dict(model=str(tiny_model_dirs[arch]), device="cuda", dtype="float32", num_gpu_blocks=512,
               max_num_batched_tokens=96, max_num_seqs=8, max_model_len=512, warmup=False)
    ref = _run(dict(cfg, tensor_parallel_size=1), tmp_path / "tp1.pt")
    got = _run(dict(cfg, tensor_parallel_size=2), tmp_path / "tp2.pt")
    _assert_graphs_ran(got)
    heads = [(0, 1), (0, 1)] if arch == "gemma3" else [(0, 1), (1, 2)]  # Gemma's one KV head is on both ranks
    assert [p["kv_heads"] for p in got["pools"]] == heads
    assert _compare(ref, got) >= len(ref["tokens"]) - 1


def test_a_rank_killed_mid_decode_fails_the_engine(tmp_path):
    p = subprocess.Popen(_cmd("die", json.dumps(dict(DUMMY, tensor_parallel_size=2, max_num_seqs=8))), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 900
        while not any(line.startswith("WORKER_PIDS") for line in lines):
            assert time.monotonic() < deadline and p.poll() is None, "".join(lines[-50:])
            if select.select([p.stdout], [], [], 1.0)[0]:
                lines.append(p.stdout.readline())
        pid = json.loads(lines[-1].split(maxsplit=1)[1])[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=DETECT_S + 30)
        elapsed = time.monotonic() - t0
        text = "".join(lines) + out
        assert "WORKER_DIED" in text and "rank 1" in text, text[-5000:]
        assert elapsed < DETECT_S, f"took {elapsed:.1f} s"
        assert p.returncode == 0, text[-5000:]
    finally:
        if p.poll() is None:
            p.kill()

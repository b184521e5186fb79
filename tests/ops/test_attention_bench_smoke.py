"""The attention benchmark script runs end to end (tiny shapes, Triton's interpreter on CPU) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention" / "bench_attention.py"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on CUDA run the real benchmark")
def test_bench_attention_cpu_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "a.json"
    assert mod.main(["--out", str(out), "--cpu-smoke", "--kv-dtypes", "bf16,fp8"]) == 0
    rec = json.loads(out.read_text())
    assert {r["kv"] for r in rec["decode"]} == {"bf16", "fp8"}
    assert len(rec["decode"]) == 4 and len(rec["prefill"]) == 6 and len(rec["mixed"]) == 2
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rec["decode"] + rec["prefill"])

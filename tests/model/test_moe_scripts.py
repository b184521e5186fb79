"""The tuning script end to end on CPU (Triton's interpreter, tiny experts): it searches, checks the chosen configs
against the reference, and writes a table the config loader reads; a second call merges buckets into it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from pdserve.ops.fused_moe_config import MoEKernelConfig, load_table

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "moe" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tuner_writes_a_table_the_loader_reads(tmp_path):
    tune = _script("tune_fused_moe")
    out = tmp_path / "table.json"
    common = ["--device", "cpu", "--experts", "8", "--inter", "16", "--hidden", "32", "--top-k", "2",
              "--dtype", "float16", "--out", str(out)]
    assert tune.main(common + ["--tokens", "3"]) == 0
    assert tune.main(common + ["--tokens", "5"]) == 0
    data = json.loads(out.read_text())
    assert data["key"] == {"E": 8, "N": 16, "K": 32, "dtype": "float16", "device": "cpu"} and data["top_k"] == 2
    assert list(data["configs"]) == ["3", "5"] and list(data["tuning"]) == ["3", "5"]
    table = load_table(str(out))
    assert table.top_k == 2 and all(isinstance(c, MoEKernelConfig) for c in table.configs.values())
    assert all(t["max_abs_err_vs_ref"] < 1e-2 for t in data["tuning"].values())
    assert data["record"]["git_commit"] is None or isinstance(data["record"]["git_commit"], str)


def test_bench_needs_cuda():
    bench = _script("bench_fused_moe")
    if not torch.cuda.is_available():
        assert bench.main(["--out", "/dev/null"]) == 2

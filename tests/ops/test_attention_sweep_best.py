"""bench_attention.py's choice of the best prefill tiles from a sweep: the highest geometric mean of speed against
the default over every swept shape."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_attention", Path(__file__).parents[2] / "benchmarks" / "attention" / "bench_attention.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def row(shape: str, bn: int, us: float | None, default: bool = False) -> dict:
    cfg = {"block_m": 128, "block_n": bn, "g_pack": 4, "num_warps": 8, "num_stages": 3}
    return {"shape": shape, "config": cfg, "default": default, **({"us": us} if us is not None else {"error": "x"})}


def test_best_is_the_highest_geometric_mean_over_shapes():
    rows = [row("a", 64, 100.0, True), row("b", 64, 10.0, True),
            row("a", 128, 80.0), row("b", 128, 11.0),  # 1.25 x 0.909: geomean 1.066
            row("a", 32, 50.0), row("b", 32, None)]  # fastest on a, failed on b: out
    best = bench.best_of_sweep(rows)
    assert best["block_n"] == 128 and abs(best["speedup_geomean_vs_default"] - (1.25 * 10 / 11) ** 0.5) < 1e-9


def test_no_best_without_the_default_on_every_shape():
    assert bench.best_of_sweep([row("a", 64, 100.0, True), row("b", 128, 5.0)]) is None

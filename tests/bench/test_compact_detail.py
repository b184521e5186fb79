"""compact_detail.py: a detailed client record loses its per-chunk gaps and texts but keeps each request's chunk
count and its long gaps (at least 1.5x the run's median), placed in the request's time."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_vllm" / "compact_detail.py"


def _mod():
    spec = importlib.util.spec_from_file_location("compact_detail", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_compact_keeps_counts_and_long_gaps(tmp_path):
    rec = {"duration": 3.0, "itls": [[0.02, 0.02, 0.05, 0.02], [0.02, 0.031], None, []],
           "generated_texts": ["abc", "de", "", ""], "errors": ["", "x" * 500, "", ""]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rec))
    _mod().compact(str(p))
    d = json.loads(p.read_text())
    assert "itls" not in d and "generated_texts" not in d
    assert d["chunks"] == [5, 3, 0, 1]
    assert d["median_gap_ms"] == 20.0
    # 50 ms (the third gap, ending 90 ms after the first chunk) and 31 ms (>= 30 ms, 1.5x the median) are long
    assert d["long_gaps"] == [[[2, 90.0, 50.0]], [[1, 51.0, 31.0]], [], []]
    assert len(d["errors"][1]) == 200 and d["duration"] == 3.0


def test_no_gaps_at_all():
    median, gaps = _mod().long_gaps([None, []])
    assert median == 0.0 and gaps == [[], []]

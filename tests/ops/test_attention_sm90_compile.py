"""The kernels compile for sm_90 (H100/H200) without a GPU, and the default bf16 configurations of Qwen3-8B's
shape (d=128, GQA 4) with bf16 and fp8 pools (prefill: with and without the new tokens' K/V read from the
step's k/v) use wgmma, fit shared memory and spill nothing (ptxas -v); the decode kernel reads its K/V tiles after
its PDL wait; with the layer's QK-norm and rotary in it (decode.ROPE_IN_DECODE) the one-row tile fits ROPE_MAXNREG
registers (4 programs an SM) without a spill. Runs benchmarks/attention/kernel_resources.py in a subprocess without
TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its bundled ptxas")
def test_default_kernels_fit_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/attention/kernel_resources.py"), "--json", str(out),
           "--only", "bf16/bf16 d=128 g=4", "--only", "bf16/fp8e4nv d=128 g=4", "--only", "kv_write bf16/"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())
    count = {k: sum(r["kernel"] == k for r in rows) for k in ("prefill", "decode", "kv_write")}
    # decode: 6 of the many-row tile, 4 many-program (bf16 and fp8 pools: MANY_PROGRAMS_TILE_FP8 with V by PTX), 4
    # few-row and 4 with the rotary in it, few-row and many-row (bf16 pool, and fp8 as ROPE_IN_DECODE_FP8 would take
    # them: with V by PTX)
    assert count == {"prefill": 8, "decode": 18, "kv_write": 3}, count
    for r in rows:
        assert r["spill_bytes"] == 0 and r["shared"] <= 227 * 1024, r
        if r.get("rope") and r.get("few"):  # decode.ROPE_MAXNREG: as the tile without it, 4 programs an SM
            assert r["registers"] <= 128, r
        if r["kernel"] == "decode":  # no K/V tile before the PDL wait (the step's kernels before it write the pool)
            assert r["v4_loads_before_wait"] == 0, r
        if r["kernel"] == "prefill":
            assert r["wgmma"] > 0, r  # Hopper tensor cores, not mma.sync

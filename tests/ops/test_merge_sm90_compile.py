"""The long-prefill merge kernel (pdserve.ops.attention.merge) compiled for sm_90 without a GPU, as its decorator
lets Triton specialize it: the pointers it does not leave free of alignment are taken as 16-byte aligned (what the
row's views always are), and the kernel must then move its outputs 16 bytes a load and a store. With no pointer
specialized it moved 2 and ran at 39 % of an H200's copy rate (benchmarks/lease_s43/s43a). Runs in a subprocess
without TRITON_INTERPRET (the interpreter builds no PTX)."""

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

SCRIPT = r"""
import json, re, sys
sys.path.insert(0, "benchmarks/attention")
from kernel_resources import compiled
from pdserve.ops.attention import merge as M

fn = M._merge_two_kernel
free = [fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize_on_alignment]
ptrs = ["O1", "L1", "O2", "L2", "Out"]
types = {"O1": "*bf16", "L1": "*fp32", "O2": "*bf16", "L2": "*fp32", "Out": "*bf16", "L": "i32"}
types.update({n: "i32" for n in fn.arg_names if n.startswith("s_")})
# the outputs' strides at the row's views (H x D or D elements) are multiples of 16, as Triton sees them at launch
strides = ["s_o1h", "s_o1t", "s_o2h", "s_o2t", "s_ot", "s_oh"]
k = compiled(fn, types, {"D": 128, "BLOCK_T": M.BLOCK_T, "BLOCK_D": 128}, M.NUM_WARPS, 1,
             [p for p in ptrs if p not in free] + strides)
ptx = k.asm["ptx"]
print(json.dumps({"free": free, "ld": re.findall(r"ld\.global(?:\.\w+)*", ptx),
                  "st": re.findall(r"st\.global(?:\.\w+)*", ptx)}))
"""


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its bundled ptxas")
def test_merge_moves_its_outputs_16_bytes_at_a_time():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert not {"O1", "O2", "Out"} & set(r["free"]), r["free"]
    assert {"L1", "L2"} <= set(r["free"]), r["free"]  # the log-sum-exp slices start anywhere: one binary for all
    # the partial outputs' loads and the output's stores are 16-byte vectors; only the log-sum-exps come 4 bytes a load
    assert r["st"] and all(s == "st.global.v4.b32" for s in r["st"]), r["st"]
    assert "ld.global.v4.b32" in r["ld"] and "ld.global.b16" not in r["ld"], r["ld"]
    assert all(x in ("ld.global.v4.b32", "ld.global.b32") for x in r["ld"]), r["ld"]

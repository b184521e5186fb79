"""run_bound.py: a serving run's work counted token by token (KV bytes, attention and product FLOPs, the fewest
decode steps' weight reads), the serial bound as the attention's larger part plus the products', independent of how
prompts are grouped into steps, and the shares a client's run reached or a target would need."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "run_bound.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("run_bound", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


P, L, B, A, W = 1000.0, 100.0, 10.0, 7.0, 5000.0  # linear and LM-head params, KV bytes a token, FLOPs a pair, weights
SIZES = {"linear_params": P, "lm_head_params": L, "kv_bytes_per_token": B, "attn_flops_per_pair": A,
         "weight_bytes_read": W}


def test_work_counted_token_by_token(mod):
    # two prompts of 4 tokens, 3 output tokens each (2 decode tokens), both at once
    w = mod.run_work(SIZES, 4, 3, 2, 2)
    # prompts read 4 tokens each; decode token 1 reads 5, token 2 reads 6: (8 + 2 * 11) tokens
    assert w["kv_bytes_read"] == pytest.approx(30 * B)
    # causal pairs of a 4-token prompt: 10; decode token t: its 4 + t - 1 cached keys plus itself: 5 + 6
    assert w["attn_flops"] == pytest.approx((2 * 10 + 2 * 11) * A)
    # 8 prompt and 4 decode tokens through the layers; 2 first tokens and 4 decoded ones sampled
    assert w["prod_flops"] == pytest.approx(2 * 12 * P + 2 * 6 * L)
    assert w["min_decode_steps"] == 2 and w["weight_bytes_read"] == pytest.approx(2 * W)
    # one request at a time: four decode steps at least
    assert mod.run_work(SIZES, 4, 3, 2, 1)["min_decode_steps"] == 4


def test_grouping_does_not_change_the_work(mod, monkeypatch):
    whole = mod.run_work(SIZES, 64, 5, 7, 3)
    monkeypatch.setattr(mod, "PREFILL_BUDGET", 64)  # one prompt a step instead of all seven
    assert mod.run_work(SIZES, 64, 5, 7, 3) == pytest.approx(whole)


def test_bound_is_the_larger_parts_summed(mod):
    ceil = {"gpu": "x", "hbm_copy_gbps": 1e-9 * 100, "bf16_matmul_tflops": 1e-12 * 1000}  # 100 B/s, 1000 FLOP/s
    b = mod.run_bound(SIZES, ceil, 4, 3, 2, 2)
    assert b["kv_read_s"] == pytest.approx(300 / 100) and b["attn_flops_s"] == pytest.approx(294 / 1000)
    assert b["weights_read_s"] == pytest.approx(10000 / 100)
    assert b["prod_flops_s"] == pytest.approx(25200 / 1000)
    assert b["attention_s"] == pytest.approx(3.0) and b["products_s"] == pytest.approx(100.0)
    assert b["bound_s"] == pytest.approx(103.0)
    assert b["bound_output_tps"] == pytest.approx(6 / 103.0)
    r = {"duration": 206.0, "output_throughput": 6 / 206.0}
    assert mod.fraction(b, r) == pytest.approx(0.5)
    assert mod.needed(b, r, 1.5) == pytest.approx(0.75)  # 1.5x faster: 137.3 s, of which the bound is 75 %


def test_rejects_empty_workloads(mod):
    with pytest.raises(ValueError):
        mod.run_work(SIZES, 1024, 0, 4, 4)


def test_cli(mod, tmp_path, capsys):
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"engine": SIZES, "ceilings": {"gpu": "x", "hbm_copy_gbps": 1e-7,
                                                              "bf16_matmul_tflops": 1e-9}}))
    res = tmp_path / "a.json"
    res.write_text(json.dumps({"duration": 206.0, "output_throughput": 6 / 206.0}))
    args = ["--steps", str(steps), "--input-len", "4", "--output-len", "3", "--num-prompts", "2",
            "--concurrency", "2", "--result", f"a={res}", "--target", "1.5", "--over", "a"]
    assert mod.main(args) == 0
    out = capsys.readouterr().out
    assert "run bound: 103.00 s" in out and "a: 206.00 s" in out and "50.0% of the bound" in out
    assert "1.5x a's output tok/s needs 75.0% of the bound" in out
    with pytest.raises(SystemExit):
        mod.main(args[:-2])  # --target without --over


def test_a_mixture_of_experts_reads_the_experts_of_its_fullest_steps(mod):
    # 8 experts, top 2, expert weights of 800 bytes and params: every token multiplies a quarter of them; the fewest
    # decode steps (2 rows each) read the experts two tokens route to: 1 - 0.75 ** 2 of them
    moe = {**SIZES, "expert_params": 800.0, "expert_bytes": 800.0, "num_experts": 8, "top_k": 2}
    w = mod.run_work(moe, 4, 3, 2, 2)
    assert w["prod_flops"] == pytest.approx(2 * 12 * (P + 200) + 2 * 6 * L)
    assert w["weight_bytes_read"] == pytest.approx(2 * (W + 800 * (1 - 0.75 ** 2)))
    assert w["kv_bytes_read"] == pytest.approx(30 * B)  # the attention's work is the dense model's

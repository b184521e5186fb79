"""TP=2 against TP=1 on CPU (gloo, two processes): the same greedy tokens and fp32 logits within LOGIT_TOL at every
sampled position, with batching, chunked prefill, preemption and prefix-cache hits happening, first eagerly, then
through the CUDA-graph data flow (decode and piecewise plans, emulated on CPU) that every rank must follow alike.
Each rank's KV pool holds its own KV heads: split for Llama/Qwen3 (2 KV heads), replicated for Gemma 3 (1)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams
from tests.engine.test_vs_transformers import capture_logits, run_to_end

pytestmark = pytest.mark.timeout(600)

# fp32: a rank's partial GEMM plus one all-reduce rounds differently from one full GEMM (measured max ~2e-7)
LOGIT_TOL = dict(atol=1e-5, rtol=1e-5)
MAX_TOKENS = 8


def _engine(path, tp: int) -> EngineCore:
    # 24 blocks of 4 tokens cannot hold every sequence at once (preemption); a 16-token budget chunks prompts
    return EngineCore(EngineConfig(model=str(path), num_gpu_blocks=24, block_size=4, max_num_batched_tokens=16,
                                   max_num_seqs=8, device="cpu", dtype="float32", tensor_parallel_size=tp))


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    return {
        "long": [rng.randrange(3, 250) for _ in range(37)],  # > the budget: chunked; > Gemma's window of 8
        "short": [7, 8, 9],
        "a": shared + [11, 12, 13],
        "b": [rng.randrange(3, 250) for _ in range(13)],
        "a2": shared + [21, 22, 23, 24],  # the second wave: a prefix hit on "a"
    }


def _run(core: EngineCore, tag: str = "") -> tuple[dict, dict]:
    captured = capture_logits(core)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    for rid, p in prompts.items():
        if rid != "a2":
            core.add_request(tag + rid, p, params)
    outs = run_to_end(core)
    core.add_request(tag + "a2", prompts["a2"], params)
    outs.update(run_to_end(core))
    return {k.removeprefix(tag): v for k, v in outs.items()}, {k.removeprefix(tag): v for k, v in captured.items()}


def _assert_same(out, logits, ref_out, ref_logits, what: str) -> None:
    assert out == ref_out, f"{what}: greedy tokens differ"
    for rid, rows in ref_logits.items():
        assert [n for n, _ in logits[rid]] == [n for n, _ in rows], f"{what} {rid}: other sampled positions"
        for (n, x), (_, y) in zip(logits[rid], rows):
            torch.testing.assert_close(x, y, **LOGIT_TOL, msg=f"{what} {rid} at {n}")


@pytest.mark.parametrize("arch,heads", [
    ("llama", [(0, 1), (1, 2)]),  # 2 KV heads: one per rank
    ("qwen3", [(0, 1), (1, 2)]),
    ("gemma3", [(0, 1), (0, 1)]),  # 1 KV head: both ranks hold it
])
def test_tp2_matches_tp1(arch, heads, tiny_model_dirs):
    ref = _engine(tiny_model_dirs[arch], 1)
    ref_out, ref_logits = _run(ref)
    assert ref.stats()["num_preemptions"] > 0 and ref.stats()["prefix_cache_hits"] >= 16
    core = _engine(tiny_model_dirs[arch], 2)
    try:
        pools = core.executor.collective_rpc("kv_pool_info")
        assert [p["rank"] for p in pools] == [0, 1]
        assert [p["kv_heads"] for p in pools] == heads
        full = ref.runner.kv_cache
        total = ref.hf_config.num_key_value_heads
        for p in pools:  # the same blocks (the scheduler's ids index every pool), each over its own heads only
            assert p["shape"][0] == full.shape[0]
            assert math.prod(p["shape"]) == full.numel() * (p["kv_heads"][1] - p["kv_heads"][0]) // total

        out, logits = _run(core)
        stats = core.stats()
        assert stats["num_preemptions"] > 0, "the test meant to exercise preemption"
        assert stats["prefix_cache_hits"] >= 16, "the test meant to exercise prefix-cache hits"
        _assert_same(out, logits, ref_out, ref_logits, f"{arch} TP=2 eager")
        assert core.runner.step_counts["eager"] > 0

        # the CUDA-graph plans (decode: padded rows into the scratch block; mixed: piecewise) on every rank
        core.executor.capture_graphs(8, core.max_model_len, 16, emulate=True)
        out, logits = _run(core, tag="g-")
        _assert_same(out, logits, ref_out, ref_logits, f"{arch} TP=2 graph plans")
        counts = core.executor.collective_rpc("step_counts")
        assert counts[0] == counts[1], "every rank runs every step the same way"
        assert counts[0]["decode_graph"] > 0 and counts[0]["mixed_graph"] > 0, counts
        core.check_whole()
    finally:
        core.close()
        ref.close()


def test_default_gemma_gguf_tp2_matches_tp1():
    """The embedded default model (Gemma 3 270M GGUF, converted once to safetensors; 1 KV head, 262k vocabulary):
    its logits are larger (|x| ~ 30), so the absolute tolerance is 1e-4 here (measured max difference 4.4e-5)."""
    out, logits = {}, {}
    for tp in (1, 2):
        core = EngineCore(EngineConfig(device="cpu", dtype="float32", num_gpu_blocks=64, max_model_len=512,
                                       tensor_parallel_size=tp))
        try:
            cap = capture_logits(core)
            for rid, p in {"a": [2, 651, 6037, 576, 6081, 603], "b": list(range(100, 140))}.items():
                core.add_request(rid, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            out[tp], logits[tp] = run_to_end(core), cap
            assert core.runner.kv_cache.shape[1] == 1  # [blocks, kv heads, layers, 2, block size, head dim]
        finally:
            core.close()
    assert out[2] == out[1]
    for rid in logits[1]:
        for (n, x), (_, y) in zip(logits[2][rid], logits[1][rid]):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-5, msg=f"{rid} at {n}")

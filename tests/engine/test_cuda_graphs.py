"""CUDA graphs on a GPU: full decode graphs and piecewise graphs of mixed steps give the eager engine's logits and
tokens (same weights, same requests), for the Triton and torch attention backends and an fp8 KV pool."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams
from tests.engine.test_vs_transformers import capture_logits, run_to_end

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(core: EngineCore):
    captured = capture_logits(core)
    g = torch.Generator().manual_seed(1)
    # prompts longer than the 96-token budget are chunked; decodes and chunks share steps
    for i, n in enumerate([5, 300, 77, 1, 130, 17, 64, 9]):
        core.add_request(str(i), torch.randint(0, 151000, (n,), generator=g).tolist(),
                         SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True))
    return run_to_end(core), captured


def _core(**kw) -> EngineCore:
    return EngineCore(EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda", num_gpu_blocks=512,
                                   max_num_batched_tokens=96, max_num_seqs=8, max_model_len=2048, **kw))


@pytest.mark.parametrize("backend,kv", [("triton", "auto"), ("torch", "auto"), ("triton", "fp8")])
def test_graphs_match_eager(backend, kv):
    eager_out, eager_logits = _run(_core(dtype="float32", attention_backend=backend, kv_cache_dtype=kv,
                                         enforce_eager=True))
    core = _core(dtype="float32", attention_backend=backend, kv_cache_dtype=kv)
    out, logits = _run(core)
    counts = core.runner.step_counts
    assert counts["mixed_graph"] > 0, counts
    if backend == "triton":  # the Triton decode kernel reads model-dtype and fp8 pools inside full graphs
        assert counts["decode_graph"] > 0, counts
    else:  # attention outside the capture: decode steps replay piecewise graphs
        assert not core.runner.decode_sizes and counts["decode_graph"] == 0
    assert counts["eager"] == 0, counts
    for rid in eager_logits:
        for (n, x), (_, y) in zip(logits[rid], eager_logits[rid]):
            torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-3, msg=f"{rid} at {n}")
    assert out == eager_out
    core.check_whole()


def test_bf16_graphs_track_eager():
    """bf16: the same kernels with and without graphs; GEMMs of padded sizes may round differently."""
    _, eager_logits = _run(_core(dtype="bfloat16", enforce_eager=True))
    core = _core(dtype="bfloat16")
    _, logits = _run(core)
    assert core.runner.step_counts["decode_graph"] > 0 and core.runner.step_counts["mixed_graph"] > 0
    for rid in eager_logits:
        for (n, x), (_, y) in zip(logits[rid][:3], eager_logits[rid][:3]):  # before greedy paths may split
            err = float((x - y).abs().max() / y.abs().max())
            assert err < 0.05, (rid, n, err)


def test_fp8_kv_close_to_model_dtype_on_cuda():
    _, ref = _run(_core(dtype="bfloat16"))
    core = _core(dtype="bfloat16", kv_cache_dtype="fp8")
    assert core.runner.kv_cache.dtype == torch.float8_e4m3fn
    _, logits = _run(core)
    for rid in ref:
        (n, x), (_, y) = logits[rid][0], ref[rid][0]  # the first token: same prompt, only the KV dtype differs
        err = float((x - y).abs().max() / y.abs().max())
        assert err < 0.15, (rid, n, err)


def test_pdl_changes_no_bit():
    """Programmatic dependent launch (pdserve.ops.pdl) changes when kernels start, never what they compute: the
    same bf16 requests give bit-identical logits and tokens with it and without."""
    from pdserve.ops.pdl import set_pdl

    runs = {}
    for mode in ("off", "early", "late"):
        prev = set_pdl(mode)
        try:
            runs[mode] = _run(_core(dtype="bfloat16"))
        finally:
            set_pdl(prev)
    out_off, logits_off = runs.pop("off")
    for mode, (out, logits) in runs.items():
        assert out == out_off, mode
        for rid in logits_off:
            for (n, x), (_, y) in zip(logits[rid], logits_off[rid]):
                assert torch.equal(x, y), (mode, rid, n)


def test_skinny_linear_tracks_cublas():
    """bf16 decode graphs of 1..8 rows with the skinny linear kernel (pdserve.ops.linear) and with cuBLAS only."""
    from pdserve.ops.linear import set_skinny

    _, ref = _run(_core(dtype="bfloat16"))
    prev = set_skinny(False)
    try:
        _, logits = _run(_core(dtype="bfloat16"))
    finally:
        set_skinny(prev)
    for rid in ref:
        for (n, x), (_, y) in zip(logits[rid][:3], ref[rid][:3]):  # before greedy paths may split
            err = float((x - y).abs().max() / y.abs().max())
            assert err < 0.05, (rid, n, err)

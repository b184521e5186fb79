"""o_proj and down_proj left as float32 partial sums over K for the add+RMSNorm after them (pdserve.ops.split_k),
inside the real models on CPU (Triton's interpreter), eager and through the CUDA-graph data flow: the same tokens
and logits as the reference path. The split is forced for every step of more than one row (on a GPU the measured
table decides)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_fused_engine import PROMPTS, _assert_same_logits, _core, _run

pytest.importorskip("triton")

from pdserve.ops import split_k  # noqa: E402
from pdserve.ops.dispatch import force_fused  # noqa: E402


@pytest.fixture
def forced_split(monkeypatch):
    """Every product of 2+ rows split in 2; records the (weight's address, rows) of each split product."""
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(split_k, "split_parts", lambda n, k, m, device: 2 if m > 1 else 1)
    real = split_k.split_linear

    def recorded(x, weight, parts):
        seen.append((weight.data_ptr(), x.shape[0]))
        return real(x, weight, parts)

    monkeypatch.setattr(split_k, "split_linear", recorded)
    return seen


def _weights(core, name: str) -> set[int]:
    return {getattr(layer.self_attn if name == "o_proj" else layer.mlp, name).weight.data_ptr()
            for layer in core.model.model.layers}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_split_products_in_the_model_match_the_reference_path(arch, tiny_model_dirs, forced_split):
    ref_out, ref_logits = _run(_core(tiny_model_dirs[arch]), max_tokens=3)
    assert not forced_split, "the CPU path never splits"
    with force_fused():
        core = _core(tiny_model_dirs[arch])
        out, logits = _run(core, max_tokens=3)
    assert {w for w, _ in forced_split} == _weights(core, "o_proj") | _weights(core, "down_proj")
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=1e-4)


def test_split_products_through_the_graph_data_flow(tiny_model_dirs, forced_split):
    with force_fused():
        ref_out, ref_logits = _run(_core(tiny_model_dirs["qwen3"], enforce_eager=True), max_tokens=5)
        core = _core(tiny_model_dirs["qwen3"])
        core.runner.capture_graphs(8, core.max_model_len, 16, emulate=True)
        out, logits = _run(core, max_tokens=5)
    counts = core.runner.step_counts
    assert counts["decode_graph"] > 0 and counts["mixed_graph"] > 0, counts
    assert forced_split
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=1e-5)


def test_one_row_mlp_keeps_its_folded_kernel_and_the_switch_turns_splits_off(tiny_model_dirs, forced_split,
                                                                              monkeypatch):
    monkeypatch.setattr(split_k, "split_parts", lambda n, k, m, device: 2)  # even one row
    with force_fused():
        core = _core(tiny_model_dirs["qwen3"])
        _run(core, max_tokens=3, prompts={"a": PROMPTS["c"]})
        down_rows = {m for w, m in forced_split if w in _weights(core, "down_proj")}
        assert down_rows and 1 not in down_rows, down_rows  # one row: act + down stay one kernel
        assert any(m == 1 for w, m in forced_split if w in _weights(core, "o_proj"))  # o_proj follows the table
        forced_split.clear()
        prev = split_k.set_split_k(False)
        try:
            _run(_core(tiny_model_dirs["qwen3"]), max_tokens=2)
        finally:
            split_k.set_split_k(prev)
    assert not forced_split


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_products_on_cuda_with_graphs(tiny_model_dirs, forced_split):
    """Compiled kernels, cuBLAS's float32 parts of 16-bit products, and the decode/mixed graphs captured with the
    split: the same greedy tokens as the plain products, logits within float16's rounding."""
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore

    def core():
        return EngineCore(EngineConfig(model=str(tiny_model_dirs["qwen3"]), device="cuda", dtype="float16",
                                       num_gpu_blocks=64, max_num_batched_tokens=64))

    out, logits = _run(core(), max_tokens=6)
    assert forced_split
    forced_split.clear()
    prev = split_k.set_split_k(False)
    try:
        ref_out, ref_logits = _run(core(), max_tokens=6)
    finally:
        split_k.set_split_k(prev)
    assert not forced_split
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=2e-2)


def test_split_products_in_a_moe_model_match_the_reference_path(tmp_path, forced_split):
    """Qwen3-MoE: the attention's o_proj splits on every layer; the sparse blocks return tensors, and the dense MLP
    of its mlp_only layer splits its down projection."""
    from tests.engine.tiny_models import write_tiny_model

    path = write_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    ref_out, ref_logits = _run(_core(path), max_tokens=2)
    with force_fused():
        core = _core(path)
        out, logits = _run(core, max_tokens=2)
    layers = core.model.model.layers
    o = {layer.self_attn.o_proj.weight.data_ptr() for layer in layers}
    dense = {layer.mlp.down_proj.weight.data_ptr() for layer in layers if hasattr(layer.mlp, "down_proj")}
    assert len(dense) == 1
    assert {w for w, _ in forced_split} == o | dense
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=1e-4)

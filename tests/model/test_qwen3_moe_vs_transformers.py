"""Qwen3-MoE in the engine against transformers on identical tiny checkpoints: logits at every sampled position and
greedy tokens, with batching, chunked prefill, prefix-cache hits and preemption. Two checkpoints: top-2 of 8
renormalised with a dense layer (mlp_only_layers), experts saved one by one; top-3 of 8 not renormalised, every
second layer sparse (decoder_sparse_step=2), experts saved stacked."""

from __future__ import annotations

import pytest
import torch

import pdserve.ops.fused_moe as fused_moe_ops
from pdserve.model.moe import FusedMoE
from pdserve.model.qwen3_moe import Qwen3MoeSparseBlock
from tests.model.conftest import MOE_ARCHS
from tests.model.engine_check import check_against_transformers

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_and_greedy_tokens_match_transformers(arch, device, moe_model_dirs):
    core = check_against_transformers(moe_model_dirs[arch], device)
    blocks = [m for m in core.model.modules() if isinstance(m, Qwen3MoeSparseBlock)]
    assert len(blocks) == (3 if arch == "qwen3_moe" else 2)


def test_triton_experts_in_the_interpreter_match_transformers(moe_model_dirs, monkeypatch):
    """The CUDA path's kernels (align, grouped GEMMs, reduce), run by Triton's interpreter inside the engine."""
    calls = []
    real = fused_moe_ops.fused_moe

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_moe_ops, "fused_moe", counting)

    def use_triton(core):
        for m in core.model.modules():
            if isinstance(m, FusedMoE):
                m.backend = "triton"

    check_against_transformers(moe_model_dirs["qwen3_moe"], "cpu", max_tokens=3, setup=use_triton, num_gpu_blocks=16)
    assert calls and max(calls) > 1 and min(calls) >= 1, "the Triton experts must have run, batched"

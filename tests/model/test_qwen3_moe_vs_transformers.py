"""Qwen3-MoE (and Qwen2-MoE) in the engine against transformers on identical tiny checkpoints: logits at every sampled
position and greedy tokens, with batching, chunked prefill, prefix-cache hits and preemption. Checkpoints: top-2 of 8
renormalised with a dense layer (mlp_only_layers), experts saved one by one; top-3 of 8 not renormalised, every
second layer sparse (decoder_sparse_step=2), experts saved stacked; Qwen2-MoE with its shared expert and q/k/v bias.
At Qwen3-30B-A3B's shapes on CUDA: one sparse block, and two layers through the engine."""

from __future__ import annotations

import pytest
import torch

import pdserve.ops.fused_moe as fused_moe_ops
from pdserve.model import moe
from pdserve.model.moe import FusedMoE, is_sparse_layer
from pdserve.model.qwen3_moe import Qwen3MoeSparseBlock
from pdserve.ops.split_k import PartialSums, materialize
from tests.model.conftest import MOE_ARCHS
from tests.model.engine_check import check_against_transformers

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_and_greedy_tokens_match_transformers(arch, device, moe_model_dirs):
    core = check_against_transformers(moe_model_dirs[arch], device)
    sparse = [i for i in range(core.hf_config.num_hidden_layers) if is_sparse_layer(core.hf_config, i)]
    assert sparse and len(sparse) < core.hf_config.num_hidden_layers  # dense and sparse layers both in play
    for i, layer in enumerate(core.model.model.layers):
        assert type(layer.mlp).__name__.endswith("SparseBlock") == (i in sparse)


def _triton_experts_in_the_interpreter(moe_model_dirs, monkeypatch) -> list:
    """Run the engine against transformers with every FusedMoE on the Triton path (the interpreter on CPU); returns
    what each fused_moe call gave (its token count, its output)."""
    calls = []
    real = fused_moe_ops.fused_moe

    def watching(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args[0].shape[0], out))
        return out

    monkeypatch.setattr(fused_moe_ops, "fused_moe", watching)

    def use_triton(core):
        for m in core.model.modules():
            if isinstance(m, FusedMoE):
                m.backend = "triton"

    check_against_transformers(moe_model_dirs["qwen3_moe"], "cpu", max_tokens=3, setup=use_triton, num_gpu_blocks=16)
    return calls


def test_triton_experts_in_the_interpreter_match_transformers(moe_model_dirs, monkeypatch):
    """The CUDA path's kernels (align, grouped GEMMs, reduce), run by Triton's interpreter inside the engine, with
    the experts' rows summed by the reduce kernel (moe.SUM_IN_NORM off: the next test has it on, as shipped)."""
    monkeypatch.setattr(moe, "SUM_IN_NORM", False)
    calls = _triton_experts_in_the_interpreter(moe_model_dirs, monkeypatch)
    assert not any(isinstance(o, PartialSums) for _, o in calls)
    tokens = [t for t, _ in calls]
    assert tokens and max(tokens) > 1 and min(tokens) >= 1, "the Triton experts must have run, batched"


def test_experts_summed_by_the_next_norm_match_transformers(moe_model_dirs, monkeypatch):
    """moe.SUM_IN_NORM (as shipped): the sparse block hands the next add+RMSNorm (or the final norm) its experts' rows,
    which that norm sums; the engine's logits and greedy tokens stay transformers'."""
    monkeypatch.setattr(moe, "SUM_IN_NORM", True)
    outs = [out for _, out in _triton_experts_in_the_interpreter(moe_model_dirs, monkeypatch)]
    assert outs and all(isinstance(o, PartialSums) for o in outs), "every sparse block's rows went to the norm"


# ------------------------------------------------------------------ Qwen3-30B-A3B shapes on CUDA
def _shipped_30b(tmp_path, layers: int) -> tuple[dict, object]:
    import json

    from pdserve.model.loader import SHIPPED_CONFIGS

    raw = json.loads((SHIPPED_CONFIGS / "qwen3-30b-a3b.json").read_text())
    raw.update(num_hidden_layers=layers, max_position_embeddings=4096)  # every other dimension as shipped
    path = tmp_path / "qwen3-30b-a3b-short.json"
    path.write_text(json.dumps(raw))
    return raw, path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 8, 100, 2048])
def test_sparse_block_at_qwen3_30b_shapes_matches_transformers(T, dtype, tmp_path):
    """One sparse block, 128 experts top-8 at hidden 2048 / expert width 768: pdserve's (routing + Triton experts)
    against transformers' on the same weights and input (identical router GEMM, so identical routing); the rows it
    hands the next norm (moe.SUM_IN_NORM) summed as that norm sums them."""
    import transformers

    from pdserve.model.loader import _config_from_dict

    raw, _ = _shipped_30b(tmp_path, 1)
    cfg = _config_from_dict(raw)
    cfg._experts_implementation = "eager"
    ref = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).to("cuda", dtype)
    with torch.device("cuda"):
        ours = Qwen3MoeSparseBlock(cfg).to(dtype)
    g = torch.Generator(device="cuda").manual_seed(T)
    with torch.no_grad():
        ref.gate.weight.copy_(torch.randn(ref.gate.weight.shape, device="cuda", generator=g) * 0.05)
        ref.experts.gate_up_proj.copy_(torch.randn(ref.experts.gate_up_proj.shape, device="cuda", generator=g) * 0.02)
        ref.experts.down_proj.copy_(torch.randn(ref.experts.down_proj.shape, device="cuda", generator=g) * 0.04)
        ours.gate.weight.copy_(ref.gate.weight)
        ours.experts.w13.copy_(ref.experts.gate_up_proj)
        ours.experts.w2.copy_(ref.experts.down_proj)
        x = torch.randn(T, raw["hidden_size"], device="cuda", generator=g).to(dtype)
        expect = ref(x[None])[0].float()
        out = ours(x)  # as shipped (moe.SUM_IN_NORM): the experts' rows, which the next add+RMSNorm would sum
        got = materialize(out).float()
    assert isinstance(out, PartialSums) == moe.SUM_IN_NORM
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(got, expect, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_layers_of_qwen3_30b_a3b_in_the_engine_match_transformers(tmp_path):
    """The shipped shape cut to two layers, dummy weights, float32, through the engine on CUDA (chunked prefill,
    decode in CUDA graphs) against transformers with the same weights. With 128 experts a token whose 8th and 9th
    router scores differ by less than the two implementations' rounding (~1e-6 relative) may pick another expert, so
    a few positions may differ; a routing, weighting or layout bug changes nearly all of them."""
    import transformers

    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.sampling_params import SamplingParams
    from tests.engine.test_vs_transformers import capture_logits, run_to_end

    _, path = _shipped_30b(tmp_path, 2)
    core = EngineCore(EngineConfig(model=str(path), load_format="dummy", device="cuda", dtype="float32",
                                   num_gpu_blocks=256, max_num_batched_tokens=512, max_model_len=4096,
                                   max_num_seqs=16))
    cfg = core.hf_config
    cfg._experts_implementation = "eager"
    with torch.device("cuda"):
        ref = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    state = {k.replace(".experts.w13", ".experts.gate_up_proj").replace(".experts.w2", ".experts.down_proj"): v
             for k, v in core.model.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    captured = capture_logits(core)
    g = torch.Generator().manual_seed(0)
    prompts = {str(i): torch.randint(0, 151000, (n,), generator=g).tolist() for i, n in enumerate([5, 300, 77, 1000])}
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    outs = run_to_end(core)
    close = total = greedy_ok = 0
    for rid, p in prompts.items():
        with torch.no_grad():
            ref_logits = ref(torch.tensor([p + outs[rid]], device="cuda")).logits[0].float()
        for num_tokens, row in captured[rid]:
            total += 1
            close += bool(torch.allclose(row, ref_logits[num_tokens - 1], atol=2e-3, rtol=1e-3))
        for i, tok in enumerate(outs[rid]):
            row = ref_logits[len(p) - 1 + i]
            greedy_ok += float(row[tok]) >= float(row.max()) - 2e-3
    assert total >= 32
    assert close >= 0.9 * total, f"only {close} of {total} sampled positions match transformers"
    assert greedy_ok >= 0.9 * sum(len(o) for o in outs.values())
    core.check_whole()


def test_router_through_linear_where_switched_on(monkeypatch):
    """moe.ROUTER_SKINNY (on as shipped): the sparse blocks' router product goes through pdserve.ops.linear.linear (the
    skinny kernel for a few rows on CUDA, F.linear here), with the same logits as nn.Linear's; off: nn.Linear."""
    import pdserve.ops.linear as lin

    seen = []
    real = lin.linear
    monkeypatch.setattr(lin, "linear", lambda x, w, b=None: seen.append(tuple(w.shape)) or real(x, w, b))
    gate = torch.nn.Linear(64, 16, bias=False)
    x = torch.randn(3, 64)
    monkeypatch.setattr(moe, "ROUTER_SKINNY", False)
    assert torch.equal(moe.router_logits(gate, x), gate(x)) and not seen
    monkeypatch.setattr(moe, "ROUTER_SKINNY", True)
    assert torch.equal(moe.router_logits(gate, x), gate(x)) and seen == [(16, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 2, 8, 16])
def test_router_through_the_skinny_kernel_cuda(T, monkeypatch):
    """moe.ROUTER_SKINNY at Qwen3-30B-A3B's router ([128 experts, 2048], bf16): the logits within bf16's rounding of
    cuBLAS's; one row runs the skinny kernel (the one-row default or the card's table)."""
    import pdserve.ops.linear as lin

    calls = []
    real = lin.skinny_linear
    monkeypatch.setattr(lin, "skinny_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(moe, "ROUTER_SKINNY", True)
    g = torch.Generator(device="cuda").manual_seed(T)
    with torch.device("cuda"):
        gate = torch.nn.Linear(2048, 128, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, device="cuda", generator=g) * 0.05)
        x = torch.randn(T, 2048, device="cuda", generator=g).to(torch.bfloat16)
        got = moe.router_logits(gate, x)
        want = torch.nn.functional.linear(x, gate.weight)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
    assert (got == want).float().mean() > 0.9, "nearly every logit the same bf16 value"
    if T == 1:
        assert calls == [1], "one row through the skinny kernel"

"""The engine with the fused kernels and the CUDA-graph data flow, on CPU:

- the Triton kernels (interpreter) inside the real models give the reference path's logits and tokens;
- the padded static-buffer flow that decode and piecewise graphs replay (emulated eagerly) gives the eager
  logits, padded decode rows write only the scratch block;
- merged projections keep Hugging Face parameter names and survive dtype moves.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams
from tests.engine.test_vs_transformers import capture_logits, run_to_end

pytest.importorskip("triton")

from pdserve.ops.dispatch import force_fused  # noqa: E402

PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [40, 41, 42], "c": list(range(60, 79))}


def _run(core: EngineCore, max_tokens: int = 4, prompts=PROMPTS) -> tuple[dict, dict]:
    captured = capture_logits(core)
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return run_to_end(core), captured


def _core(path, **kw) -> EngineCore:
    kw.setdefault("num_gpu_blocks", 32)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("dtype", "float32")
    return EngineCore(EngineConfig(model=str(path), device="cpu", **kw))


def _assert_same_logits(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert [n for n, _ in a[rid]] == [n for n, _ in b[rid]]
        for (n, x), (_, y) in zip(a[rid], b[rid]):
            torch.testing.assert_close(x, y, atol=atol, rtol=atol, msg=f"{rid} at {n}")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fused_kernels_in_the_model_match_the_reference_path(arch, tiny_model_dirs, monkeypatch):
    from pdserve.ops import activation, norm, rotary

    calls: dict[str, int] = defaultdict(int)
    for mod, name in ((norm, "rms_norm_triton"), (norm, "fused_add_rms_norm_triton"),
                      (norm, "add_rms_norm_rows_triton"), (rotary, "qk_norm_rope_triton"),
                      (activation, "act_and_mul_triton")):
        def counted(*a, _f=getattr(mod, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    ref_out, ref_logits = _run(_core(tiny_model_dirs[arch]), max_tokens=3)
    assert not calls, "the CPU path uses the references"
    with force_fused():
        out, logits = _run(_core(tiny_model_dirs[arch]), max_tokens=3)
    assert len(calls) == 5, dict(calls)  # every kernel ran inside the model
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_activation_folded_into_one_row_down_projection_matches_the_reference_path(arch, tiny_model_dirs,
                                                                                    monkeypatch):
    """One request decoding (one row a step) in float16: each layer's activation runs inside the down
    projection's kernel (pdserve.ops.linear.skinny_act_linear); tokens as the reference path's, logits within
    float16's rounding."""
    from pdserve.ops import linear as lin
    from pdserve.ops import norm_fold

    calls = []
    real = lin.skinny_act_linear
    monkeypatch.setattr(lin, "skinny_act_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setattr(norm_fold, "_enabled", False)  # the norms' kernels (their fold: the next test)
    one = {"a": PROMPTS["c"]}
    ref_out, ref_logits = _run(_core(tiny_model_dirs[arch], dtype="float16"), max_tokens=3, prompts=one)
    with force_fused():
        core = _core(tiny_model_dirs[arch], dtype="float16")
        out, logits = _run(core, max_tokens=3, prompts=one)
    layers = core.runner.model.config.num_hidden_layers
    assert len(calls) == 2 * layers and all(c[0] == 1 for c in calls), calls  # two one-row decode steps
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_norms_folded_into_one_row_products_match_the_reference_path(arch, tiny_model_dirs, monkeypatch):
    """One request decoding (one row a step) in float16: the add+RMSNorm after o_proj and after each down_proj but
    the last is folded into the products around it (pdserve.ops.norm_fold); tokens as the reference path's and as
    the norms' own kernels give, logits within float16's rounding."""
    from pdserve.ops import norm_fold

    made, taken = [], []
    real_produce, real_linear = norm_fold.produce, norm_fold.NormedRow.linear
    monkeypatch.setattr(norm_fold, "produce", lambda *a, **kw: made.append(kw.get("act", a[6] if len(a) > 6
                                                                                else None)) or real_produce(*a, **kw))
    monkeypatch.setattr(norm_fold.NormedRow, "linear", lambda self, *a: taken.append(1) or real_linear(self, *a))
    import pdserve.model.parallel as par
    monkeypatch.setattr(par, "produce", norm_fold.produce)
    one = {"a": PROMPTS["c"]}
    ref_out, ref_logits = _run(_core(tiny_model_dirs[arch], dtype="float16"), max_tokens=3, prompts=one)
    with force_fused():
        core = _core(tiny_model_dirs[arch], dtype="float16")
        out, logits = _run(core, max_tokens=3, prompts=one)
        monkeypatch.setattr(norm_fold, "_enabled", False)
        import pdserve.model.layers as layers_mod
        products = []
        real_lin = layers_mod.linear
        monkeypatch.setattr(layers_mod, "linear", lambda x, *a: products.append(x.shape[0]) or real_lin(x, *a))
        apart_out, apart_logits = _run(_core(tiny_model_dirs[arch], dtype="float16"), max_tokens=3, prompts=one)
    layers = core.runner.model.config.num_hidden_layers
    assert products.count(1) == 2 * 2 * layers  # without the fold each one-row product still runs once (q/k/v, gate_up)
    # two one-row decode steps: each layer's o_proj and every down_proj but the last leave their norm to the next
    assert made == 2 * ([None, "silu"] * (layers - 1) + [None]), made
    assert len(taken) == len(made)
    assert out == ref_out == apart_out
    _assert_same_logits(logits, ref_logits, atol=2e-2)
    _assert_same_logits(logits, apart_logits, atol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kv_written_by_the_rotary_kernel_equals_the_backends_write(arch, tiny_model_dirs, monkeypatch):
    """The Triton attention backend in the interpreter: with `writes_kv_early` the rotary kernel writes each layer's
    new K/V and the backend's write_kv never runs; the pool, the logits and the tokens are those of the backend's
    own write (the same bytes: the kernel stores the keys it returns)."""
    from pdserve.ops.attention import decode
    from pdserve.ops.attention import triton_backend as tb

    monkeypatch.setattr(decode, "ROPE_IN_DECODE", False)  # the rotary kernel's write in every step (as Llama's)
    writes = []
    real = tb.write_kv
    monkeypatch.setattr(tb, "write_kv", lambda *a, **kw: writes.append(1) or real(*a, **kw))
    with force_fused():
        monkeypatch.setattr(tb.TritonAttentionBackend, "writes_kv_early", False)
        ref_core = _core(tiny_model_dirs[arch], attention_backend="triton")
        ref_out, ref_logits = _run(ref_core, max_tokens=3)
        assert writes, "the backend wrote the KV itself"
        writes.clear()
        monkeypatch.setattr(tb.TritonAttentionBackend, "writes_kv_early", True)
        core = _core(tiny_model_dirs[arch], attention_backend="triton")
        out, logits = _run(core, max_tokens=3)
    assert not writes, "the rotary kernel wrote every layer's KV"
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=0.0)
    assert torch.equal(core.runner.kv_cache, ref_core.runner.kv_cache)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_rope_in_the_decode_kernel_gives_the_rotary_kernels_tokens(arch, tiny_model_dirs, monkeypatch):
    """decode.ROPE_IN_DECODE (as shipped, on) in the interpreter, against it off: decode-only steps of models with a QK-norm (Qwen3; Gemma 3's 1 +
    weight and sliding window) leave the norm, rotary and K/V write to the decode kernel, so the rotary kernel runs
    only in the other steps; the tokens, logits and pool are those of the rotary kernel's path. (Llama, with no
    QK-norm, keeps the rotary kernel: decode.rope_in_decode, tests/ops/test_attention_decode.py.)"""
    from pdserve.ops import rotary
    from pdserve.ops.attention import decode

    calls = []
    real = rotary.qk_norm_rope_triton
    monkeypatch.setattr(rotary, "qk_norm_rope_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    folds = []
    real_decode = decode.paged_decode
    monkeypatch.setattr("pdserve.ops.attention.triton_backend.paged_decode",
                        lambda *a, **kw: folds.append(kw.get("rope") is not None) or real_decode(*a, **kw))
    monkeypatch.setattr(decode, "ROPE_IN_DECODE", False)
    with force_fused():
        ref_core = _core(tiny_model_dirs[arch], attention_backend="triton")
        ref_out, ref_logits = _run(ref_core, max_tokens=5)
        ref_calls, calls[:] = len(calls), []
        assert not any(folds)
        folds.clear()
        monkeypatch.setattr(decode, "ROPE_IN_DECODE", True)
        core = _core(tiny_model_dirs[arch], attention_backend="triton")
        out, logits = _run(core, max_tokens=5)
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=1e-5)
    torch.testing.assert_close(core.runner.kv_cache, ref_core.runner.kv_cache, atol=1e-5, rtol=1e-5)
    layers = core.runner.model.config.num_hidden_layers
    # every decode-only step's layers: 4 steps of 3 rows after the prompts at least
    assert sum(folds) >= 4 * layers and len(calls) == ref_calls - sum(folds), (sum(folds), len(calls), ref_calls)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_graph_data_flow_matches_eager(arch, tiny_model_dirs):
    ref_out, ref_logits = _run(_core(tiny_model_dirs[arch], enforce_eager=True), max_tokens=6)
    core = _core(tiny_model_dirs[arch])
    core.runner.capture_graphs(8, core.max_model_len, 16, emulate=True)
    scratch = core.runner.kv_cache[core.runner.scratch_block]
    scratch.fill_(1000.0)  # a sentinel, far from any real K/V: it must never reach a real row
    out, logits = _run(core, max_tokens=6)
    counts = core.runner.step_counts
    assert counts["decode_graph"] > 0 and counts["mixed_graph"] > 0, counts
    assert out == ref_out
    _assert_same_logits(logits, ref_logits, atol=1e-5)
    written = scratch != 1000.0
    assert written.any(), "three decode rows padded to a graph of four: the fourth writes the scratch block"
    assert written[:, :, :, 1:].sum() == 0, "padded rows write their one token at the scratch block's first slot"
    core.check_whole()


def test_layer_hook_runs_once_per_layer_in_graph_steps(tiny_model_dirs):
    core = _core(tiny_model_dirs["gemma3"])
    core.runner.capture_graphs(8, core.max_model_len, 16, emulate=True)
    calls: list[int] = []
    core.add_request("x", [3, 4, 5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    batch = core.scheduler.schedule()
    core.runner.execute(batch, calls.append)
    assert calls == list(range(core.hf_config.num_hidden_layers))
    assert core.runner.step_counts["mixed_graph"] == 1


def test_merged_projections_keep_checkpoint_names(tiny_model_dirs):
    import transformers

    from tests.engine.tiny_models import hf_model

    core = _core(tiny_model_dirs["llama"])
    ref = hf_model(tiny_model_dirs["llama"])
    ours = core.model.state_dict()
    assert set(ours) == set(ref.state_dict()) | ({"lm_head.weight"} - set(ref.state_dict()))
    attn = core.model.model.layers[0].self_attn
    mlp = core.model.model.layers[0].mlp
    # the HF-named parameters are the rows of the merged weights
    assert torch.equal(attn.qkv_weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_size:].data_ptr()
    new = {k: torch.randn_like(v) for k, v in ours.items()}
    core.model.load_state_dict(new)
    assert torch.equal(attn.qkv_weight[attn.q_size + attn.kv_size:], new["model.layers.0.self_attn.v_proj.weight"])
    assert torch.equal(mlp.gate_up_weight[mlp.gate_proj.weight.shape[0]:], new["model.layers.0.mlp.up_proj.weight"])
    core.model.to(torch.float64)  # a move re-stacks, so the merged weights follow the parameters
    assert attn.qkv_weight.dtype == torch.float64 and attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    with torch.no_grad():
        attn.q_proj.weight.fill_(0.5)
    assert attn.qkv_weight[: attn.q_size].eq(0.5).all()
    assert isinstance(transformers.__version__, str)


def test_fp8_kv_cache_runs_close_to_the_model_dtype(tiny_model_dirs):
    """fp8 K/V change the logits a little (3 mantissa bits), never the engine's bookkeeping."""
    path = tiny_model_dirs["qwen3"]
    _, ref_logits = _run(_core(path), max_tokens=4)
    core = _core(path, kv_cache_dtype="fp8")
    assert core.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert core.block_bytes * 4 == _core(path).block_bytes  # float32 model: a quarter of the bytes
    _, logits = _run(core, max_tokens=4)
    worst = defaultdict(float)
    for rid in ref_logits:
        for (_, x), (_, y) in zip(logits[rid], ref_logits[rid]):
            worst[rid] = max(worst[rid], float((x - y).abs().max() / y.abs().max()))
    assert max(worst.values()) < 0.1, worst
    assert max(worst.values()) > 0, "fp8 storage must actually round"
    core.check_whole()


def test_kv_scales_load_from_the_checkpoint(tiny_model_dirs, tmp_path):
    import shutil

    from safetensors.torch import save_file

    src = tiny_model_dirs["qwen3"]
    dst = tmp_path / "qwen3-fp8kv"
    shutil.copytree(src, dst)
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.v_scale": torch.tensor(0.5)}, str(dst / "kv_scales.safetensors"))
    core = _core(dst, kv_cache_dtype="fp8_e5m2")
    assert core.runner.kv_cache.dtype == torch.float8_e5m2
    layers = core.model.model.layers
    assert float(layers[0].self_attn.k_scale) == 1.0 and float(layers[0].self_attn.v_scale) == 1.0
    assert float(layers[1].self_attn.k_scale) == 0.25 and float(layers[1].self_attn.v_scale) == 0.5
    assert layers[1].self_attn.k_scale.dtype == torch.float32
    plain = _core(src, kv_cache_dtype="fp8_e5m2")
    _run(core, max_tokens=1)
    _run(plain, max_tokens=1)
    # the pool holds k / k_scale: layer 1's stored K is 4x, its V 2x what it is with unit scales; layer 0 the same
    for kv, want in ((0, 4.0), (1, 2.0)):
        ratio = core.runner.kv_cache[:, :, 1, kv].float().norm() / plain.runner.kv_cache[:, :, 1, kv].float().norm()
        assert abs(float(ratio) - want) < 0.1 * want, (kv, float(ratio))
    assert torch.equal(core.runner.kv_cache[:, :, 0].float(), plain.runner.kv_cache[:, :, 0].float())


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_every_configurable_kv_cache_dtype_has_a_pool_dtype():
    from pdserve.config import KV_CACHE_DTYPES
    from pdserve.engine.runner import kv_cache_torch_dtype

    got = {name: kv_cache_torch_dtype(name, torch.bfloat16) for name in KV_CACHE_DTYPES}
    assert got == {"auto": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}

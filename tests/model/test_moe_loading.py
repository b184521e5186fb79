"""Loading Qwen3-MoE checkpoints: per-expert and stacked layouts land in the same stacked parameters, a checkpoint
with a missing, doubled or misshapen expert is refused, the sparse/dense layer rule is transformers', and the shipped
Qwen3-30B-A3B shape builds with the published size."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.model.loader import build_model, load_config, resolve_model
from pdserve.model.moe import FusedMoE
from pdserve.model.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseBlock, is_sparse_layer
from pdserve.model.shapes import head_dim, num_experts
from tests.engine.tiny_models import TINY


def _load(path):
    cfg, src = load_config(resolve_model(str(path)))
    return build_model(cfg, src, torch.device("cpu"), torch.float32, "auto", 0)


def _hf_tiny(arch: str, seed: int = 0):
    import transformers

    spec = TINY[arch]
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**spec["kw"])).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def two_layouts(tmp_path_factory):
    """One random model saved per expert (transformers' default) and stacked (its in-memory layout)."""
    model = _hf_tiny("qwen3_moe")
    root = tmp_path_factory.mktemp("layouts")
    model.save_pretrained(root / "per_expert")
    model.save_pretrained(root / "stacked", save_original_format=False)
    return model, root / "per_expert", root / "stacked"


def test_both_layouts_are_on_disk_as_claimed(two_layouts):
    _, per_expert, stacked = two_layouts
    a, b = _tensors(per_expert), _tensors(stacked)
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in a and "model.layers.0.mlp.experts.gate_up_proj" not in a
    assert "model.layers.0.mlp.experts.gate_up_proj" in b and "model.layers.0.mlp.experts.0.up_proj.weight" not in b


def test_per_expert_and_stacked_checkpoints_load_the_same_weights(two_layouts):
    hf, per_expert, stacked = two_layouts
    a, b = _load(per_expert), _load(stacked)
    sd_a, sd_b, sd_hf = a.state_dict(), b.state_dict(), hf.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    for i in (0, 1, 3):  # layer 2 is dense (mlp_only_layers)
        p = f"model.layers.{i}.mlp"
        assert torch.equal(sd_a[f"{p}.experts.w13"], sd_hf[f"{p}.experts.gate_up_proj"])
        assert torch.equal(sd_a[f"{p}.experts.w2"], sd_hf[f"{p}.experts.down_proj"])
        assert torch.equal(sd_a[f"{p}.gate.weight"], sd_hf[f"{p}.gate.weight"])
    # gate rows first, then up rows, as the checkpoint's per-expert matrices say
    t = _tensors(per_expert)
    inter = TINY["qwen3_moe"]["kw"]["moe_intermediate_size"]
    w13 = sd_a["model.layers.1.mlp.experts.w13"]
    assert torch.equal(w13[5, :inter], t["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(w13[5, inter:], t["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(sd_a["model.layers.1.mlp.experts.w2"][5], t["model.layers.1.mlp.experts.5.down_proj.weight"])


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = _tensors(src)
    edit(tensors)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_missing_expert_is_refused(two_layouts, tmp_path):
    _, per_expert, _ = two_layouts
    bad = _rewrite(per_expert, tmp_path / "bad", lambda t: t.pop("model.layers.3.mlp.experts.6.up_proj.weight"))
    with pytest.raises(ValueError, match=r"weights missing .*model\.layers\.3\.mlp\.experts\.w13"):
        _load(bad)


def test_an_expert_written_twice_is_refused(two_layouts, tmp_path):
    _, per_expert, stacked = two_layouts
    both = _tensors(stacked)
    bad = _rewrite(per_expert, tmp_path / "bad",
                   lambda t: t.update({"model.layers.1.mlp.experts.down_proj": both["model.layers.1.mlp.experts.down_proj"]}))
    with pytest.raises(ValueError, match="second time"):
        _load(bad)


def test_a_misshapen_expert_is_refused(two_layouts, tmp_path):
    _, per_expert, _ = two_layouts
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    bad = _rewrite(per_expert, tmp_path / "bad", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=r"experts\.2\.gate_proj\.weight has shape"):
        _load(bad)


@pytest.mark.parametrize("step, dense", [(1, []), (1, [0, 3]), (2, []), (3, [2])])
def test_sparse_layers_follow_transformers(step, dense):
    import transformers

    kw = dict(TINY["qwen3_moe"]["kw"], num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=dense)
    cfg = transformers.Qwen3MoeConfig(**kw)
    with torch.device("meta"):
        ref = transformers.Qwen3MoeForCausalLM(cfg)
        ours = Qwen3MoeForCausalLM(cfg)
    for i in range(6):
        hf_sparse = type(ref.model.layers[i].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        assert is_sparse_layer(cfg, i) == hf_sparse
        assert isinstance(ours.model.layers[i].mlp, Qwen3MoeSparseBlock) == hf_sparse
        if not hf_sparse:  # the dense MLP is full width, not the parent's placeholder
            assert ours.model.layers[i].mlp.down_proj.weight.shape == (kw["hidden_size"], kw["intermediate_size"])


def test_shipped_qwen3_30b_a3b_shape(tmp_path, monkeypatch):
    from pathlib import Path

    import pdserve.model.loader as loader
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.model.dummy_tokenizer import tokenizer_path_for

    src = resolve_model("qwen3-30b-a3b")
    assert src.kind == "shipped"
    cfg, src = load_config(src)
    raw = json.loads(Path(loader.SHIPPED_CONFIGS / "qwen3-30b-a3b.json").read_text())
    assert (num_experts(cfg), cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        raw["num_experts"], raw["num_experts_per_tok"], raw["moe_intermediate_size"])
    assert head_dim(cfg) == raw["head_dim"] and cfg.norm_topk_prob is True
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == raw["num_hidden_layers"]
    assert tuple(moe[0].w13.shape) == (128, 2 * 768, 2048) and tuple(moe[0].w2.shape) == (128, 2048, 768)
    total = sum(p.numel() for p in model.parameters())
    assert round(total / 1e9, 1) == 30.5  # the model card's "30.5B in total"
    with pytest.raises(ValueError, match="--load-format dummy"):
        build_model(cfg, src, torch.device("meta"), torch.bfloat16, "safetensors", 0)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # the word-level tokenizer shipped shapes get
    tok = Tokenizer.load(tokenizer_path_for(src, cfg))
    assert tok.vocab_size == raw["vocab_size"] and tok.eos_token_id == raw["eos_token_id"]
    assert tok.decode(tok.encode("t5 t151000", add_special_tokens=False)) == "t5 t151000"


def test_dummy_weights_fill_the_stacked_experts(tmp_path):
    import transformers

    d = dict(TINY["qwen3_moe"]["kw"], architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    (tmp_path / "tiny.json").write_text(json.dumps(d))
    src = resolve_model(str(tmp_path / "tiny.json"))
    cfg, src = load_config(src)
    model = build_model(cfg, src, torch.device("cpu"), torch.float32, "dummy", 0)
    w13 = model.model.layers[0].mlp.experts.w13
    assert torch.isfinite(w13).all() and 0.005 < w13.abs().mean() < 0.02
    assert isinstance(cfg, transformers.Qwen3MoeConfig)

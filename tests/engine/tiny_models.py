"""Tiny random-weight checkpoints written as Hugging Face directories by transformers itself, so the engine is
compared with the reference implementation on identical weights."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "llama": dict(
        cls="LlamaConfig",
        kw=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
        model="LlamaForCausalLM",
    ),
    "qwen3": dict(
        cls="Qwen3Config",
        kw=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_theta=1000000.0, bos_token_id=1, eos_token_id=2),
        model="Qwen3ForCausalLM",
    ),
    "gemma3": dict(
        cls="Gemma3TextConfig",
        kw=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=8,
                query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                       "full_attention"],
                bos_token_id=1, eos_token_id=2, pad_token_id=0),
        model="Gemma3ForCausalLM",
    ),
    # Qwen3-MoE: 8 experts, top-2, renormalised; layer 2 dense (mlp_only_layers); experts saved one by one, the
    # layout of the published checkpoints (transformers' default save)
    "qwen3_moe": dict(
        cls="Qwen3MoeConfig",
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
                bos_token_id=1, eos_token_id=2),
        model="Qwen3MoeForCausalLM",
        moe=True,
    ),
    # Qwen3-MoE: top-3 of 8 not renormalised, every second layer sparse (decoder_sparse_step=2); experts saved
    # stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I]), transformers 5's in-memory layout
    "qwen3_moe_step2": dict(
        cls="Qwen3MoeConfig",
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, num_experts=8,
                num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                bos_token_id=1, eos_token_id=2),
        model="Qwen3MoeForCausalLM",
        moe=True,
        save_kw=dict(save_original_format=False),
    ),
    # Qwen2-MoE: biased q/k/v, top-2 of 8 plus a sigmoid-gated shared expert; layer 1 dense
    "qwen2_moe": dict(
        cls="Qwen2MoeConfig",
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                bos_token_id=1, eos_token_id=2),
        model="Qwen2MoeForCausalLM",
        moe=True,
    ),
}


def write_tiny_model(arch: str, out: Path, seed: int = 0) -> Path:
    import transformers

    spec = TINY[arch]
    cfg = getattr(transformers, spec["cls"])(**spec["kw"])
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(cfg).to(torch.float32)
    with torch.no_grad():  # norms start at their neutral value; perturb them so the test sees their math
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif spec.get("moe") and (".mlp.gate." in name or ".mlp.experts." in name):
                # unit-scale routers and experts: decisive routing, and experts that move the logits
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            elif spec.get("moe") and name.endswith(".bias"):  # biases start at zero: make them count
                p.copy_(torch.randn_like(p) * 0.1)
    save_kw = spec.get("save_kw", {})
    try:
        model.save_pretrained(out, **save_kw)
    except TypeError:  # a transformers without save_original_format saves its in-memory (stacked) layout anyway
        model.save_pretrained(out)
    return out


def hf_model(path: Path):
    import json

    import transformers

    kw = {}
    if "moe" in json.loads((Path(path) / "config.json").read_text()).get("model_type", ""):
        kw["experts_implementation"] = "eager"  # transformers' plain loop over experts, the clearest oracle
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                             **kw).eval()

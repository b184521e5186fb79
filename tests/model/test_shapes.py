"""head_dim() and num_experts() read objects and plain dicts alike, with transformers' conventions."""

from __future__ import annotations

import transformers

from pdserve.model.shapes import head_dim, num_experts
from tests.engine.tiny_models import TINY


def test_head_dim_explicit_or_derived():
    qwen3 = transformers.Qwen3Config(**TINY["qwen3"]["kw"])
    llama = transformers.LlamaConfig(**TINY["llama"]["kw"])
    assert head_dim(qwen3) == qwen3.head_dim == 32  # set apart from hidden / heads (64 / 4)
    assert head_dim(llama) == llama.hidden_size // llama.num_attention_heads
    assert head_dim({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert head_dim({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": None}) == 128
    assert head_dim({"hidden_size": 640, "num_attention_heads": 4, "head_dim": 256}) == 256


def test_num_experts_in_every_spelling():
    moe = transformers.Qwen3MoeConfig(**TINY["qwen3_moe"]["kw"])
    assert num_experts(moe) == TINY["qwen3_moe"]["kw"]["num_experts"]
    assert num_experts(moe.to_dict()) == TINY["qwen3_moe"]["kw"]["num_experts"]  # saved as num_local_experts
    assert num_experts({"n_routed_experts": 256}) == 256
    assert num_experts(transformers.LlamaConfig(**TINY["llama"]["kw"])) == 0

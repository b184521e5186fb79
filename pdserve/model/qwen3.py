"""Qwen3 (dense): the Llama block plus RMS norms on each head's queries and keys before RoPE."""

from __future__ import annotations

from pdserve.model.llama import LlamaForCausalLM, LlamaModel


class Qwen3Model(LlamaModel):
    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    inner_cls = Qwen3Model

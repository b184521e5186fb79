"""Architectures by the name Hugging Face configs give them; imported lazily so a registry lookup is cheap."""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pdserve.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pdserve.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("pdserve.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pdserve.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("pdserve.model.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Gemma3ForCausalLM": ("pdserve.model.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("pdserve.model.gemma3", "Gemma3ForCausalLM"),
}

# The architecture a config without `architectures` (or a GGUF's converted config) means, by its model_type.
MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in _REGISTRY:
            mod, name = _REGISTRY[arch]
            return getattr(importlib.import_module(mod), name)
    raise ValueError(
        f"unsupported model architecture {architectures!r}; pdserve supports {', '.join(supported_architectures())}"
    )

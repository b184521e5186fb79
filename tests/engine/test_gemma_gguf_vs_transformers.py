"""The embedded default model (Gemma 3 270M, Q4_K_M GGUF): greedy continuations match transformers loading the
same GGUF, token for token, for 32 tokens, with the prompts batched together in the engine."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@pytest.mark.slow
def test_default_gguf_greedy_matches_transformers(monkeypatch):
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    # transformers parses the file twice (config, then tensors); parsing Gemma's 262k-token vocabulary is most of
    # a minute each time. The second parse reads the same file: reuse the first reader.
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))

    from pdserve import LLM, SamplingParams
    from pdserve.model.default_model import resolve_model_path

    llm = LLM()
    res = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    gguf = resolve_model_path(None)
    from pathlib import Path

    p = Path(gguf)
    ref = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    for prompt, r in zip(PROMPTS, res):
        ids = torch.tensor([r.prompt_token_ids])
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        expect = g[0, ids.shape[1]:].tolist()
        assert r.outputs[0].token_ids == expect, f"{prompt!r}: {r.outputs[0].text!r}"
        assert len(expect) == 32

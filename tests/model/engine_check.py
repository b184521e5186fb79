"""Drive the engine over a tiny checkpoint and compare every sampled position's logits, and the greedy tokens,
with transformers on the same weights (the check tests/engine/test_vs_transformers.py makes for dense models)."""

from __future__ import annotations

import random

import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams
from tests.engine.test_vs_transformers import capture_logits, run_to_end
from tests.engine.tiny_models import hf_model


def make_prompts(seed: int = 0) -> tuple[list[int], dict[str, list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    prompts = {
        "long": [rng.randrange(3, 250) for _ in range(37)],  # > the token budget: chunked prefill
        "short": [7, 8, 9],
        "a": shared + [11, 12, 13],
        "b": [rng.randrange(3, 250) for _ in range(13)],
        "c": [rng.randrange(3, 250) for _ in range(9)],
    }
    return shared, prompts


def check_against_transformers(path, device: str, max_tokens: int = 10, setup=None, num_gpu_blocks: int = 24,
                               atol: float = 2e-4, rtol: float = 1e-4) -> EngineCore:
    """Batched requests with chunked prefill, preemption (24 blocks of 4 tokens cannot hold them all) and a second
    wave that hits the prefix cache; `setup(core)` may adjust the model before the first step."""
    ref = hf_model(path)
    core = EngineCore(EngineConfig(model=str(path), num_gpu_blocks=num_gpu_blocks, block_size=4,
                                   max_num_batched_tokens=16, max_num_seqs=8, device=device, dtype="float32"))
    if setup is not None:
        setup(core)
    captured = capture_logits(core)
    shared, prompts = make_prompts()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        core.add_request(rid, p, params)
    outs = run_to_end(core)
    prompts["a2"] = shared + [21, 22, 23, 24]
    core.add_request("a2", prompts["a2"], params)
    outs.update(run_to_end(core))
    stats = core.stats()
    assert stats["num_preemptions"] > 0, "the test meant to exercise preemption"
    assert stats["prefix_cache_hits"] >= 16, "the test meant to exercise prefix-cache hits"

    for rid, prompt in prompts.items():
        full = prompt + outs[rid]
        assert len(outs[rid]) == max_tokens
        with torch.no_grad():
            ref_logits = ref(torch.tensor([full])).logits[0].float()
        assert len(captured[rid]) >= max_tokens, "every sampled position must be compared"
        for num_tokens, row in captured[rid]:
            torch.testing.assert_close(row.cpu(), ref_logits[num_tokens - 1], atol=atol, rtol=rtol,
                                       msg=f"{path.name} {rid} at {num_tokens}")
        with torch.no_grad():
            g = ref.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        assert outs[rid] == g[0, len(prompt):].tolist(), f"{path.name} {rid}: greedy tokens differ"
    core.kv.pool.check_whole()
    return core

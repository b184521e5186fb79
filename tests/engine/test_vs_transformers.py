"""The engine against transformers on identical weights: logits at every sampled position and greedy tokens,
with batching, chunked prefill, prefix-cache hits, sliding windows and preemption all happening."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams
from tests.engine.tiny_models import hf_model


def capture_logits(core: EngineCore):
    captured: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    orig = core.runner.forward_logits

    def wrapped(batch, after_layer=None):
        logits, reqs = orig(batch, after_layer)
        for r, row in zip(reqs, logits if logits is not None else []):
            captured[r.request_id].append((r.num_tokens, row.detach().float().clone()))
        return logits, reqs

    core.runner.forward_logits = wrapped
    return captured


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for _ in range(10_000):
        if not core.has_work():
            break
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    assert not core.has_work(), "engine did not drain"
    return out


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_logits_and_greedy_tokens_match_transformers(arch, device, tiny_model_dirs):
    path = tiny_model_dirs[arch]
    ref = hf_model(path)
    # 24 blocks of 4 tokens cannot hold every sequence at once: preemption; a 16-token budget chunks prompts
    core = EngineCore(EngineConfig(model=str(path), num_gpu_blocks=24, block_size=4, max_num_batched_tokens=16,
                                   max_num_seqs=8, device=device, dtype="float32"))
    captured = capture_logits(core)
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    prompts = {
        "long": [rng.randrange(3, 250) for _ in range(37)],  # > budget: chunked; > sliding window of 8
        "short": [7, 8, 9],
        "a": shared + [11, 12, 13],
        "b": [rng.randrange(3, 250) for _ in range(13)],
        "c": [rng.randrange(3, 250) for _ in range(9)],
    }
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        core.add_request(rid, p, params)
    outs = run_to_end(core)
    # a second wave shares the prefix of "a", which is now in the prefix cache
    core.add_request("a2", shared + [21, 22, 23, 24], params)
    prompts["a2"] = shared + [21, 22, 23, 24]
    outs.update(run_to_end(core))
    stats = core.stats()
    assert stats["num_preemptions"] > 0, "the test meant to exercise preemption"
    assert stats["prefix_cache_hits"] >= 16, "the test meant to exercise prefix-cache hits"

    for rid, prompt in prompts.items():
        full = prompt + outs[rid]
        assert len(outs[rid]) == 10
        with torch.no_grad():
            ref_logits = ref(torch.tensor([full])).logits[0].float()
        assert len(captured[rid]) >= 10, "every sampled position must be compared"
        for num_tokens, row in captured[rid]:
            expect = ref_logits[num_tokens - 1]
            torch.testing.assert_close(row.cpu(), expect, atol=2e-4, rtol=1e-4, msg=f"{arch} {rid} at {num_tokens}")
        with torch.no_grad():
            g = ref.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert outs[rid] == g[0, len(prompt):].tolist(), f"{arch} {rid}: greedy tokens differ"
    core.kv.pool.check_whole()


def test_logprobs_are_the_model_distribution(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    ref = hf_model(path)
    core = EngineCore(EngineConfig(model=str(path), num_gpu_blocks=64, block_size=4))
    prompt = [5, 6, 7, 8, 9, 10]
    core.add_request("x", prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))
    toks, lps = [], []
    while core.has_work():
        for o in core.step():
            toks += o.new_token_ids
            lps += o.logprobs
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt + toks])).logits[0].float(), -1)
    for i, (tok, (chosen, top)) in enumerate(zip(toks, lps)):
        row = ref_lp[len(prompt) - 1 + i]
        assert abs(chosen - float(row[tok])) < 1e-4
        ids, vals = zip(*top)
        assert list(ids) == row.topk(3).indices.tolist()
        assert max(abs(a - b) for a, b in zip(vals, row.topk(3).values.tolist())) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dummy_qwen3_06b_on_cuda_matches_transformers(backend):
    """A realistic shape on the GPU: the engine's random weights copied into transformers' Qwen3."""
    import transformers

    core = EngineCore(EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="float32",
                                   num_gpu_blocks=256, max_num_batched_tokens=256, attention_backend=backend))
    ref = transformers.Qwen3ForCausalLM(core.hf_config).cuda().float().eval()
    missing, unexpected = ref.load_state_dict(core.model.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    captured = capture_logits(core)
    g = torch.Generator().manual_seed(0)
    prompts = {str(i): torch.randint(0, 151000, (n,), generator=g).tolist() for i, n in enumerate([5, 300, 77, 1000])}
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    outs = run_to_end(core)
    for rid, p in prompts.items():
        with torch.no_grad():
            ref_logits = ref(torch.tensor([p + outs[rid]], device="cuda")).logits[0].float()
        for num_tokens, row in captured[rid]:
            torch.testing.assert_close(row, ref_logits[num_tokens - 1], atol=2e-3, rtol=1e-3)
        for i, tok in enumerate(outs[rid]):  # greedy: our token is the reference's best (ties within rounding)
            row = ref_logits[len(p) - 1 + i]
            assert float(row[tok]) >= float(row.max()) - 2e-3
    core.check_whole()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_row_norm_fold_on_cuda_is_as_close_to_transformers_as_the_norm_kernels():
    """Dummy Qwen3-0.6B in bfloat16, one request at a time (one-row decode steps, eager so the switch applies): the
    norms folded into the products around them (pdserve.ops.norm_fold) and the norms' own kernels, each against
    transformers in float32 on the same weights over its own tokens; the fold no further from it than the kernels."""
    import transformers

    from pdserve.ops import norm_fold

    core = EngineCore(EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
                                   num_gpu_blocks=256, max_num_batched_tokens=512, enforce_eager=True))
    ref = transformers.Qwen3ForCausalLM(core.hf_config).cuda().eval()
    ref.load_state_dict(core.model.state_dict(), strict=False)
    ref = ref.float()
    captured = capture_logits(core)
    prompt = torch.randint(0, 151000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    errors = {}
    for fold in (True, False):
        prev = norm_fold.set_norm_fold(fold)
        try:
            rid = f"fold={fold}"
            core.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            out = run_to_end(core)[rid]
        finally:
            norm_fold.set_norm_fold(prev)
        with torch.no_grad():
            ref_logits = ref(torch.tensor([prompt + out], device="cuda")).logits[0].float()
        decode = [(n, row) for n, row in captured[rid] if n > len(prompt)]
        assert len(decode) >= 7  # (async scheduling may run one step past the last token)
        errors[fold] = max(float((row - ref_logits[n - 1]).abs().max()) for n, row in decode)
    assert errors[True] <= 1.25 * errors[False] + 2e-2, errors

"""The one-pass sampling kernel (pdserve.ops.sampling): greedy rows equal torch's argmax (ties to the first index),
sampled rows follow softmax(logits / T) (frequencies over many rows of one distribution), -inf tokens are never
drawn, the seed picks the stream; the same checks of the torch form. On CPU the kernel runs in Triton's interpreter;
on CUDA (marked gpu) compiled, at Qwen3's vocabulary."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops.dispatch import force_fused
from pdserve.ops.sampling import sample_tokens

triton = pytest.importorskip("triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _draw(logits, inv_temp, seed, fused):
    with force_fused(fused):
        return sample_tokens(logits.to(DEV), inv_temp.to(DEV), seed).cpu()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_the_argmax_first_index_on_ties(fused, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((5, 4100), generator=g).to(dtype)  # past two of the kernel's 2048-entry steps
    x[1, 7] = x[1, 4000] = 50.0  # a tie across steps: the first wins
    x[2, 2047] = x[2, 2048] = 50.0  # across the step boundary
    x[3, :] = 1.0  # all equal: token 0
    x[4, 4099] = float("inf")
    out = _draw(x, torch.zeros(5), 1, fused)
    assert out.tolist() == x.argmax(-1).tolist()
    assert out.tolist()[:4] == [x[0].argmax().item(), 7, 2047, 0]


@pytest.mark.parametrize("fused", [False, True])
def test_sampled_rows_follow_the_tempered_softmax(fused):
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, float("-inf"), 3.0, 0.0, 1.5])
    interpreted = fused and DEV.type == "cpu"  # a program a row: ~13 ms each in the interpreter
    rows, temp = (500, 0.7) if interpreted else (4000, 0.7)
    tol = 0.07 if interpreted else 0.03  # ~3.5 standard deviations of a frequency (<= 0.02 and <= 0.008)
    out = _draw(logits.repeat(rows, 1), torch.full((rows,), 1 / temp), 11, fused)
    freq = torch.bincount(out, minlength=8).float() / rows
    p = torch.softmax(logits / temp, -1)
    assert freq[4] == 0  # a -inf token is never drawn
    assert (freq - p).abs().max() < tol, (freq, p)
    assert (freq - torch.softmax(logits, -1)).abs().max() > tol  # and not the untempered distribution


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_and_sampled_rows_in_one_batch_and_the_seed(fused):
    g = torch.Generator().manual_seed(1)
    x = torch.randn((6, 300), generator=g)
    inv = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0, 0.0])
    a = _draw(x, inv, 5, fused)
    assert _draw(x, inv, 5, fused).tolist() == a.tolist()  # the same seed: the same draws
    greedy = x.argmax(-1)
    assert [a[i].item() for i in (0, 2, 5)] == [greedy[i].item() for i in (0, 2, 5)]
    draws = {tuple(_draw(x, inv, s, fused)[[1, 3, 4]].tolist()) for s in range(6)}
    assert len(draws) > 1  # other seeds, other draws


def test_refuses_more_rows_than_the_random_offsets_address():
    x = torch.empty((2**16, 2**15), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="offsets"):
        sample_tokens(x, torch.zeros(2**16, device="meta"), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_qwen3_vocabulary_on_cuda():
    v = 151936
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn((256, v), generator=g, device="cuda").to(torch.bfloat16)
    assert torch.equal(sample_tokens(x, torch.zeros(256, device="cuda"), 3), x.argmax(-1))
    small = torch.full((20000, 4), float("-inf"), device="cuda")
    small[:, :3] = torch.tensor([0.0, 1.0, 2.0], device="cuda")
    wide = torch.full((20000, v), float("-inf"), device="cuda", dtype=torch.bfloat16)
    wide[:, [10, 70000, v - 1]] = torch.tensor([0.0, 1.0, 2.0], device="cuda", dtype=torch.bfloat16)
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1)
    for logits, ids in ((small, [0, 1, 2]), (wide, [10, 70000, v - 1])):
        out = sample_tokens(logits, torch.ones(20000, device="cuda"), 4).cpu()
        freq = torch.tensor([(out == i).float().mean().item() for i in ids])
        assert freq.sum() == 1.0 and (freq - p).abs().max() < 0.015, freq


def test_sampler_routes_plain_batches_to_the_kernel(monkeypatch):
    """pdserve.engine.sampler: a batch of greedy rows and plain temperature rows goes through the kernel (under
    force_fused on CPU: the interpreter) with 1/T per row and 0 for greedy; greedy rows get the argmax; a batch with a
    filter, a seed or logprobs keeps the torch path; an all-greedy batch keeps torch's argmax."""
    from pdserve.engine import sampler as S
    from pdserve.engine.request import Request
    from pdserve.sampling_params import SamplingParams

    calls = []
    real = S.sample_tokens

    def spy(logits, inv_temp, seed):
        calls.append(inv_temp.tolist())
        return real(logits, inv_temp, seed)

    monkeypatch.setattr(S, "sample_tokens", spy)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn((4, 64), generator=g).to(torch.bfloat16)

    def reqs(*params):
        return [Request(f"r{i}", [1, 2], SamplingParams(**p), frozenset()) for i, p in enumerate(params)]

    plain = reqs({"temperature": 0.0}, {}, {"temperature": 0.5}, {"temperature": 0.0})
    with force_fused(True):
        out = S.sample_async(logits, plain).result().token_ids
    assert calls == [[0.0, 1.0, 2.0, 0.0]]
    assert [out[0], out[3]] == [logits[0].argmax().item(), logits[3].argmax().item()]
    assert all(0 <= t < 64 for t in out)
    for other in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 3}, {"logprobs": 1},
                  {"presence_penalty": 0.5}):
        batch = reqs({}, other)
        for r in batch:
            r.generator = torch.Generator().manual_seed(3) if r.params.seed is not None else None
        with force_fused(True):
            S.sample_async(logits[:2].float(), batch).result()
    with force_fused(True):
        greedy = S.sample_async(logits, reqs(*[{"temperature": 0.0}] * 4)).result().token_ids
    assert greedy == logits.argmax(-1).tolist()
    assert len(calls) == 1  # only the plain batch took the kernel
    with force_fused(False):
        S.sample_async(logits, plain).result()  # CPU: the torch path
    assert len(calls) == 1

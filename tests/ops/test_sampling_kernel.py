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
    x = torch.randn((7, 4100), generator=g).to(dtype)  # past two of the kernel's 2048-entry steps
    x[1, 7] = x[1, 4000] = 50.0  # a tie across steps: the first wins
    x[2, 2047] = x[2, 2048] = 50.0  # across the step boundary
    x[3, :] = 1.0  # all equal: token 0
    x[4, 4099] = float("inf")
    x[5, 600] = x[5, 300] = 50.0  # the later column in a lower lane of the kernel's 512 (600 - 512 = 88 < 300)
    x[6, 2148] = x[6, 1900] = 50.0  # the same across steps
    out = _draw(x, torch.zeros(7), 1, fused)
    assert out.tolist() == x.argmax(-1).tolist()
    assert out.tolist()[:4] + out.tolist()[5:] == [x[0].argmax().item(), 7, 2047, 0, 300, 1900]


@pytest.mark.parametrize("fused", [False, True])
def test_sampled_rows_follow_the_tempered_softmax(fused):
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, float("-inf"), 3.0, 0.0, 1.5])
    interpreted = fused and DEV.type == "cpu"  # a program a row: ~13 ms each in the interpreter
    rows, temp = (400, 0.7) if interpreted else (4000, 0.7)
    tol = 0.075 if interpreted else 0.03  # ~3.3 standard deviations of a frequency (<= 0.023 and <= 0.008)
    out = _draw(logits.repeat(rows, 1), torch.full((rows,), 1 / temp), 11, fused)
    freq = torch.bincount(out, minlength=8).float() / rows
    p = torch.softmax(logits / temp, -1)
    assert freq[4] == 0  # a -inf token is never drawn
    assert (freq - p).abs().max() < tol, (freq, p)
    assert (freq - torch.softmax(logits, -1)).abs().max() > tol  # and not the untempered distribution


def test_rows_split_over_programs_sample_the_same_distribution(monkeypatch):
    """A row over several programs (here 16 columns a program's step: 40 tokens over 3 programs) and the pick of their
    partial bests: the tempered softmax, ties to the first index."""
    from pdserve.ops import sampling

    monkeypatch.setattr(sampling, "QUARTER", 4)
    assert sampling.split_plan(200, 40, 132) == (3, 16) and sampling.split_plan(300, 40, 132) == (2, 32)
    assert sampling.split_plan(2, 40, 132) == (3, 16)
    logits = torch.full((40,), float("-inf"))
    logits[[3, 20, 39]] = torch.tensor([0.0, 1.0, 2.0])
    interpreted = DEV.type == "cpu"
    rows, tol = (200, 0.1) if interpreted else (8000, 0.02)  # fixed seeds: the same draws every run
    out = _draw(logits.repeat(rows, 1), torch.full((rows,), 1.0), 3, True)
    freq = torch.tensor([(out == i).float().mean().item() for i in (3, 20, 39)])
    assert freq.sum() == 1.0 and (freq - torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1)).abs().max() < tol, freq
    tie = torch.zeros((2, 40))
    tie[0, [5, 17, 33]] = 9.0  # in each of the three programs: the first wins
    tie[1, [30, 38]] = 9.0
    assert _draw(tie, torch.zeros(2), 0, True).tolist() == [5, 30]


def test_split_plan_fills_the_sms():
    from pdserve.ops.sampling import QUARTER, split_plan

    step = 4 * QUARTER
    assert split_plan(1, 151936, 132) == (75, step)  # one row alone: every 2048-column step its own program
    s, chunk = split_plan(256, 151936, 132)
    assert s == 3 and chunk % step == 0 and s * chunk >= 151936 > (s - 1) * chunk
    assert split_plan(1024, 151936, 132) == (1, 75 * step)


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


def test_more_rows_than_one_random_stream_addresses_go_in_parts(monkeypatch):
    from pdserve.ops import sampling

    seen = []
    real = sampling.sample_tokens

    def spy(logits, inv_temp, seed, **launch):
        seen.append((logits.shape[0], seed))
        return real(logits, inv_temp, seed, **launch)

    monkeypatch.setattr(sampling, "sample_tokens", spy)
    x = torch.empty((2**18 + 5, 2**15), dtype=torch.bfloat16, device="meta")
    try:
        real(x, torch.zeros(2**18 + 5, device="meta"), 7)
    except (NotImplementedError, RuntimeError):  # meta tensors: nothing runs; the split before it is what is tested
        pass
    part = (2**31 - 1) // 2**13  # 2**15 tokens: 16 steps of 2048 columns, 512 offsets each
    assert seen[:1] == [(part, 8)]


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
    one = torch.ones(1, device="cuda")  # one row alone: split over 75 programs, then the pick
    out = torch.cat([sample_tokens(wide[:1], one, seed) for seed in range(6000)]).cpu()
    freq = torch.tensor([(out == i).float().mean().item() for i in [10, 70000, v - 1]])
    assert freq.sum() == 1.0 and (freq - p).abs().max() < 0.025, freq


def test_sampler_routes_plain_batches_to_the_kernel(monkeypatch):
    """pdserve.engine.sampler: a batch of greedy rows and plain temperature rows goes through the kernel (under
    force_fused on CPU: the interpreter) with 1/T per row and 0 for greedy; greedy rows get the argmax; a batch with a
    filter, a seed or logprobs keeps the torch path; an all-greedy batch keeps torch's argmax."""
    from pdserve.engine import sampler as S
    from pdserve.engine.request import Request
    from pdserve.sampling_params import SamplingParams

    calls = []
    real = S.sample_tokens
    dev = DEV

    def spy(logits, inv_temp, seed):
        calls.append(inv_temp.tolist())
        return real(logits, inv_temp, seed)

    monkeypatch.setattr(S, "sample_tokens", spy)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn((4, 64), generator=g).to(torch.bfloat16).to(dev)

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
            r.generator = torch.Generator(device=dev).manual_seed(3) if r.params.seed is not None else None
        with force_fused(True):
            S.sample_async(logits[:2].float(), batch).result()
    with force_fused(True):
        greedy = S.sample_async(logits, reqs(*[{"temperature": 0.0}] * 4)).result().token_ids
    assert greedy == logits.argmax(-1).tolist()
    assert len(calls) == 1  # only the plain batch took the kernel
    if dev.type == "cpu":
        with force_fused(False):
            S.sample_async(logits, plain).result()  # CPU: the torch path
        assert len(calls) == 1

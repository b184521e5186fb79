"""The sampler's logit processing against a straightforward per-row reference of vLLM's definitions.

Reference (one row at a time, plain Python loops over tokens): repetition penalty divides the positive logits and
multiplies the negative logits of every token present in the prompt or the output; frequency penalty subtracts
penalty x count in the output; presence penalty subtracts penalty once for every token present in the output;
logit_bias adds its value (clamped to [-100, 100]); allowed_token_ids keeps only those; min_tokens bans EOS and
stop ids. Applied in vLLM's order: allowed, min_tokens, logit_bias, then penalties.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import sampler as S
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams

VOCAB = 97
EOS = 3


def make_request(rng: random.Random, i: int, **params) -> Request:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    req = Request(f"r{i}", prompt, SamplingParams(**params), frozenset({EOS}))
    for _ in range(rng.randint(0, 15)):  # output tokens with repeats, so counts go above 1
        req.append_token(rng.choice(prompt + [rng.randrange(VOCAB)]))
    return req


def reference_row(logits: list[float], req: Request) -> list[float]:
    p = req.params
    out = list(logits)
    if p.allowed_token_ids is not None:
        out = [v if t in p.allowed_token_ids else float("-inf") for t, v in enumerate(out)]
    if p.min_tokens and req.num_output_tokens < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS]):
            out[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    output = req.output_token_ids
    seen = set(req.prompt_token_ids) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count
        out[t] -= p.presence_penalty * (1 if count else 0)
    return out


def random_params(rng: random.Random) -> dict:
    params: dict = {}
    if rng.random() < 0.6:
        params["repetition_penalty"] = rng.choice([0.5, 1.0, 1.3, 2.0])
    if rng.random() < 0.6:
        params["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        params["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.3:
        params["logit_bias"] = {str(rng.randrange(VOCAB)): rng.uniform(-150, 150) for _ in range(3)}
    if rng.random() < 0.2:
        params["allowed_token_ids"] = rng.sample(range(VOCAB), 5)
    if rng.random() < 0.3:
        params.update(min_tokens=30, max_tokens=64, stop_token_ids=[rng.randrange(VOCAB)])
    return params


@pytest.mark.parametrize("seed", range(5))
def test_processed_logits_equal_the_reference(seed):
    rng = random.Random(seed)
    reqs = [make_request(rng, i, **random_params(rng)) for i in range(12)]
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    before = logits.clone()
    got = S.process_logits(logits, reqs)
    assert torch.equal(logits, before), "the input logits were modified"
    want = torch.tensor([reference_row(before[i].tolist(), r) for i, r in enumerate(reqs)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_penalties_are_applied_in_chunks_of_rows_identically(monkeypatch):
    rng = random.Random(7)
    reqs = [make_request(rng, i, repetition_penalty=1.5, frequency_penalty=0.5) for i in range(9)]
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(1))
    whole = S.process_logits(logits, reqs)
    monkeypatch.setattr(S, "PENALTY_CHUNK_ELEMENTS", 2 * (VOCAB + 1))  # two rows per chunk
    torch.testing.assert_close(S.process_logits(logits, reqs), whole)


def test_greedy_choice_follows_the_penalised_logits():
    rng = random.Random(3)
    reqs = [make_request(rng, i, temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
                         repetition_penalty=1.7, logit_bias={"5": 3.0}) for i in range(6)]
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    want = [max(range(VOCAB), key=reference_row(logits[i].tolist(), r).__getitem__) for i, r in enumerate(reqs)]
    assert S.sample(logits, reqs).token_ids == want


def test_logit_bias_of_100_forces_a_token_and_allowed_ids_restrict_sampling():
    rng = random.Random(4)
    forced = make_request(rng, 0, temperature=1.0, seed=1, logit_bias={"42": 100})
    allowed = make_request(rng, 1, temperature=1.0, seed=2, allowed_token_ids=[7, 8])
    plain = make_request(rng, 2, temperature=0)
    logits = torch.zeros(3, VOCAB)
    logits[:, 11] = 10.0
    for _ in range(20):
        result = S.sample(logits, [forced, allowed, plain])
        assert result.token_ids[0] == 42 and result.token_ids[1] in (7, 8) and result.token_ids[2] == 11


def test_raw_logprobs_are_taken_before_processing():
    rng = random.Random(5)
    req = make_request(rng, 0, temperature=0, logprobs=2, logit_bias={"9": 100})
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    result = S.sample(logits, [req])
    raw = torch.log_softmax(logits, -1)[0]
    assert result.token_ids == [9]
    chosen, top = result.logprobs[0]
    assert chosen == pytest.approx(float(raw[9]))
    assert [t for t, _ in top] == torch.topk(raw, 2).indices.tolist()


def test_top_k_beyond_the_vocabulary_is_no_filter():
    rng = random.Random(6)
    huge = make_request(rng, 0, temperature=1.0, seed=9, top_k=2**62)
    none = make_request(rng, 1, temperature=1.0, seed=9)
    for r in (huge, none):
        r.generator = torch.Generator().manual_seed(9)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)).repeat(2, 1)
    a, b = S.sample(logits, [huge, none]).token_ids
    assert a == b


def test_out_of_vocabulary_ids_never_fail_a_step():
    """The server refuses them, but a request that reaches the engine directly must still not break the batch."""
    rng = random.Random(8)
    bad = make_request(rng, 0, temperature=0, min_tokens=5, stop_token_ids=[300000],
                       logit_bias={"300001": 5.0}, allowed_token_ids=[1, 300002])
    ok = make_request(rng, 1, temperature=0)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    tokens = S.sample(logits, [bad, ok]).token_ids
    assert tokens == [1, int(logits[1].argmax())]

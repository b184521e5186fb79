"""The sampler in row chunks: the same tokens and logprobs as the whole batch at once (greedy and seeded rows; any
mix of top-p, top-k, penalties and logprobs), and memory bounded by a chunk, not the batch."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import sampler as S
from pdserve.engine.memory_profile import probe_params
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams
from tests.engine.live_bytes import LiveBytes

VOCAB = 500


def batch(n: int, seed: int) -> tuple[torch.Tensor, list[Request]]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        kind = rng.choice(["greedy", "seeded", "greedy_lp", "seeded_filters", "penalized"])
        params: dict = {"temperature": 0.0} if kind.startswith("greedy") else {"temperature": 0.9, "seed": i}
        if kind == "greedy_lp":
            params["logprobs"] = rng.choice([0, 3, 7])
        if kind == "seeded_filters":
            params.update(top_p=0.8, top_k=40, min_p=0.01, logprobs=2)
        if kind == "penalized":
            params.update(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
        req = Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(5)], SamplingParams(**params), frozenset())
        for _ in range(rng.randint(0, 6)):
            req.append_token(rng.randrange(VOCAB))
        reqs.append(req)
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)), reqs


def run(logits: torch.Tensor, reqs: list[Request]):
    for r in reqs:  # a fresh generator per run: both runs draw the same numbers for a seeded row
        r.generator = torch.Generator().manual_seed(r.params.seed) if r.params.seed is not None else None
    return S.sample_async(logits, reqs).result()


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 32])
def test_chunks_give_the_whole_batch_tokens_and_logprobs(monkeypatch, rows_per_chunk):
    logits, reqs = batch(45, seed=rows_per_chunk)
    whole = run(logits, reqs)
    monkeypatch.setattr(S, "SAMPLER_CHUNK_ELEMENTS", VOCAB * rows_per_chunk)
    assert S.sampler_chunk_rows(len(reqs), VOCAB) == rows_per_chunk
    chunked = run(logits, reqs)
    assert chunked.token_ids == whole.token_ids
    for a, b, r in zip(chunked.logprobs, whole.logprobs, reqs):
        if r.params.logprobs is None:
            assert a is None and b is None
            continue
        assert a[0] == pytest.approx(b[0], abs=1e-6)
        assert [t for t, _ in a[1]] == [t for t, _ in b[1]] and len(a[1]) == r.params.logprobs


def test_a_greedy_batch_is_one_argmax(monkeypatch):
    logits, _ = batch(10, seed=1)
    reqs = [Request(f"g{i}", [1], SamplingParams(temperature=0.0), frozenset()) for i in range(10)]
    monkeypatch.setattr(S, "SAMPLER_CHUNK_ELEMENTS", VOCAB)  # one row a chunk, were it chunked
    assert run(logits, reqs).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_greedy_batch_of_16_bit_logits_takes_their_argmax_without_a_float_copy(dtype):
    """Every row greedy with nothing that changes the logits: the argmax runs on the logits' own dtype, and gives the
    float32 argmax's ids, ties included (rows with repeated maxima after rounding pick the first)."""
    logits = (torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    logits[0, 7] = logits[0, 300] = logits[0].max() + 1  # a tie: the first index wins in both
    reqs = [Request(f"g{i}", [1], SamplingParams(temperature=0.0), frozenset()) for i in range(12)]
    assert run(logits, reqs).token_ids == logits.float().argmax(-1).tolist()
    assert run(logits, reqs).token_ids[0] == 7
    mode = LiveBytes()
    with mode:
        S.sample_async(logits, reqs).result()
    assert mode.peak < logits.numel() * 4  # no [rows, vocab] float32 copy


def peak_bytes(logits: torch.Tensor, reqs: list[Request]) -> int:
    mode = LiveBytes()
    with mode:
        S.sample_async(logits, reqs).result()
    return mode.peak


def test_the_probe_steps_sampler_memory_is_bounded_by_a_chunk(monkeypatch):
    """The KV sizing probe's sampler (every row top-p, top-k, penalties, logprobs): the whole batch at once holds
    about ten float32 copies of the logits; in chunks, about ten copies of a chunk."""
    n, vocab = 128, 8192
    logits = torch.randn(n, vocab).to(torch.bfloat16)
    reqs = [Request(f"p{i}", [i, i + 1], probe_params(), frozenset()) for i in range(n)]
    monkeypatch.setattr(S, "SAMPLER_CHUNK_ELEMENTS", 1 << 40)
    whole = peak_bytes(logits, reqs)
    assert whole > 6 * n * vocab * 4  # the measure sees the batch's float32 temporaries
    monkeypatch.setattr(S, "SAMPLER_CHUNK_ELEMENTS", 16 * vocab)
    chunked = peak_bytes(logits, reqs)
    assert chunked < 16 * 16 * vocab * 4
    assert chunked < whole / 4

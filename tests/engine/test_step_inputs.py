"""The runner's vectorized step inputs against a per-token Python reference (the old prepare loop): random
mixes of decode rows, prefill chunks and prefix hits, with and without the padding CUDA graphs use."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.step_inputs import BlockRows, Staging, fill
from pdserve.sampling_params import SamplingParams

BS = 4


def _batch(rng: random.Random, n_reqs: int, decode_only: bool):
    reqs, num_new, next_block = [], [], 0
    for i in range(n_reqs):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 30))]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=50))
        r.token_ids += [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 6))]
        if decode_only:
            r.num_computed_tokens = r.num_tokens - 1
            n = 1
        else:
            r.num_computed_tokens = rng.randrange(0, r.num_tokens)  # prefix hit / earlier chunks
            n = rng.randrange(1, r.num_tokens - r.num_computed_tokens + 1)  # maybe not to the end: no sample
        nb = -(-(r.num_computed_tokens + n) // BS) + rng.randrange(0, 2)
        r.block_ids = rng.sample(range(100), nb) if rng.random() < 0.5 else list(range(next_block, next_block + nb))
        next_block += nb
        reqs.append(r)
        num_new.append(n)
    return reqs, num_new


def _reference(reqs, num_new):
    ids, pos, slots, qsl, lens, sample = [], [], [], [0], [], []
    for r, n in zip(reqs, num_new):
        s, e = r.num_computed_tokens, r.num_computed_tokens + n
        ids += r.token_ids[s:e]
        pos += list(range(s, e))
        slots += [r.block_ids[p // BS] * BS + p % BS for p in range(s, e)]
        qsl.append(qsl[-1] + n)
        lens.append(e)
        if e == r.num_tokens:
            sample.append(qsl[-1] - 1)
    return ids, pos, slots, qsl, lens, sample


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decode_only", [False, True])
def test_fill_matches_the_per_token_loop(seed, decode_only):
    rng = random.Random(seed)
    staging = Staging(torch.device("cpu"), 64)  # tiny on purpose: it must grow
    cache = BlockRows() if seed % 2 else None
    for _ in range(3):  # consecutive steps alternate host buffers
        reqs, num_new = _batch(rng, rng.randrange(1, 9), decode_only)
        inp = fill(staging, reqs, num_new, BS, block_rows=cache)
        ids, pos, slots, qsl, lens, sample = _reference(reqs, num_new)
        assert inp.ids.tolist() == ids and inp.positions.tolist() == pos and inp.slots.tolist() == slots
        assert inp.query_start_loc == qsl and inp.qsl_t.tolist() == qsl
        assert inp.seq_lens == lens and inp.seq_lens_t.tolist() == lens
        assert inp.sample_idx.tolist() == sample
        assert [r.request_id for r in inp.sample_reqs] == [r.request_id for r, n in zip(reqs, num_new)
                                                           if r.num_computed_tokens + n == r.num_tokens]
        assert inp.decode_only == all(n == 1 for n in num_new)
        for i, r in enumerate(reqs):
            row = inp.block_tables[i].tolist()
            assert row[: len(r.block_ids)] == r.block_ids and set(row[len(r.block_ids):]) <= {-1}
        assert inp.ids.dtype == torch.int64 and inp.block_tables.dtype == torch.int32
        base = staging._hosts[staging._slot].data_ptr()  # every region on 16 bytes (Triton specializes on it)
        for t in (inp.ids, inp.positions, inp.slots, inp.seq_lens_t, inp.qsl_t, inp.block_tables, inp.sample_idx,
                  inp.prefill_tiles):
            if t is not None:
                assert (t.data_ptr() - base) % 16 == 0  # Triton's tt.divisibility


def test_graph_padding_points_at_the_scratch_block():
    rng = random.Random(7)
    reqs, num_new = _batch(rng, 3, True)
    scratch = 100
    inp = fill(Staging(torch.device("cpu"), 1 << 16), reqs, num_new, BS, pad_ids=8, pad_rows=8, width=32,
               pad_slot=scratch * BS, pad_block=scratch, slots_padded=True)
    ids, pos, slots, qsl, lens, _ = _reference(reqs, num_new)
    assert inp.ids.tolist() == ids + [0] * 5 and inp.positions.tolist() == pos + [0] * 5
    assert inp.slots.tolist() == slots + [scratch * BS] * 5
    assert inp.seq_lens_t.tolist() == lens + [1] * 5 and inp.seq_lens == lens
    assert inp.qsl_t.tolist() == list(range(9))
    assert inp.block_tables.shape == (8, 32) and (inp.block_tables[3:] == scratch).all()
    assert inp.num_tokens == 3


def test_mixed_graph_padding_pads_only_ids_and_positions():
    rng = random.Random(8)
    reqs, num_new = _batch(rng, 4, False)
    t = sum(num_new)
    inp = fill(Staging(torch.device("cpu"), 1 << 16), reqs, num_new, BS, pad_ids=t + 11)
    assert inp.ids.shape == (t + 11,) and inp.slots.shape == (t,) and inp.seq_lens_t.shape == (4,)
    assert inp.ids[t:].eq(0).all() and inp.positions[t:].eq(0).all()


def test_a_fixed_staging_buffer_refuses_to_grow():
    rng = random.Random(9)
    reqs, num_new = _batch(rng, 8, False)
    with pytest.raises(ValueError):
        fill(Staging(torch.device("cpu"), 64, growable=False), reqs, num_new, BS, width=4096)


def test_cached_block_rows_follow_every_change_of_the_lists():
    """Rows grow in place, lists get replaced (prefix hit, free, preemption), requests leave and come back."""
    rng = random.Random(11)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams()) for i in range(6)]
    for r in reqs:
        r.block_ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
    cache = BlockRows()
    for step in range(60):
        for r in reqs:
            u = rng.random()
            if u < 0.4:
                r.block_ids.extend(rng.randrange(1000) for _ in range(rng.randrange(1, 40)))  # grows past capacity
            elif u < 0.5:
                r.block_ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]  # a new list
            elif u < 0.55:
                r.block_ids = []
        batch = [r for r in reqs if rng.random() < 0.8]
        rows = cache.rows(batch)
        assert [row.tolist() for row in rows] == [r.block_ids for r in batch], step

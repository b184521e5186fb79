"""What rank 0 sends the other ranks each step: a StepPlan survives its flat encoding, the RowMirror rebuilds
exactly rank 0's block-table rows from the deltas through every kind of change, and a decode step's frame is
O(batch) integers whatever the context lengths."""

from __future__ import annotations

import random
import time

import numpy as np

from pdserve.engine.request import Request
from pdserve.engine.step_inputs import BlockRows, RowDelta, RowMirror, StepPlan, gather
from pdserve.engine.worker import TAG_STEP
from pdserve.sampling_params import SamplingParams


def _decode_batch(n: int, blocks: int) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", list(range(blocks * 16)), SamplingParams())
        r.num_computed_tokens = r.num_tokens - 1
        r.block_ids = list(range(i * blocks, (i + 1) * blocks))
        reqs.append(r)
    return reqs


def test_plan_round_trip():
    reqs = _decode_batch(5, 3)
    reqs[2].num_computed_tokens = 10  # a prefill chunk among decodes
    num_new = [1, 1, 6, 1, 1]
    arrays = gather(reqs, num_new)
    delta = RowDelta()
    rows = BlockRows().rows(reqs, delta)
    plan = StepPlan.build("mixed", 16, arrays, delta)
    buf = plan.encode(TAG_STEP)
    assert buf[0] == TAG_STEP
    back = StepPlan.decode(np.frombuffer(buf.tobytes(), dtype=np.int64)[1:])
    assert (back.kind, back.size) == ("mixed", 16)
    for f in ("ids", "starts", "num_new", "sampled"):
        assert np.array_equal(getattr(back.arrays, f), getattr(arrays, f)), f
    mirrored = RowMirror().apply(back.keys, back.keep, back.counts, back.new_ids)
    assert [r.tolist() for r in mirrored] == [r.tolist() for r in rows]


def test_mirror_follows_every_change_of_the_lists():
    """Rows grow in place, lists get replaced (prefix hit, free, preemption), requests leave and come back."""
    rng = random.Random(7)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams()) for i in range(8)]
    for r in reqs:
        r.block_ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
    cache, mirror = BlockRows(), RowMirror()
    for step in range(80):
        for r in reqs:
            u = rng.random()
            if u < 0.4:
                r.block_ids.extend(rng.randrange(1000) for _ in range(rng.randrange(1, 40)))
            elif u < 0.5:
                r.block_ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
            elif u < 0.55:
                r.block_ids = []
        batch = [r for r in reqs if rng.random() < 0.8]
        delta = RowDelta()
        rows = cache.rows(batch, delta)
        plan = StepPlan.build("eager", 0, gather([], []), delta)
        got = mirror.apply(plan.keys, plan.keep, plan.counts, plan.new_ids)
        assert [g.tolist() for g in got] == [r.tolist() for r in rows] == [r.block_ids for r in batch], step


def test_mirror_of_steady_decoding():
    """The same batch step after step, rows growing now and then (the mirror's fast path), a list replaced once."""
    rng = random.Random(3)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams()) for i in range(16)]
    for r in reqs:
        r.block_ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
    cache, mirror = BlockRows(), RowMirror()
    rebuilds = []
    rebuild = mirror._rebuild
    mirror._rebuild = lambda *a: rebuilds.append(1) or rebuild(*a)
    for step in range(60):
        for r in reqs:
            if rng.random() < 0.1:
                r.block_ids.append(rng.randrange(1000))
        if step == 30:
            reqs[5].block_ids = [7, 8]  # preempted and readmitted: a new list
        delta = RowDelta()
        rows = cache.rows(reqs, delta)
        plan = StepPlan.build("decode", 16, gather([], []), delta)
        got = mirror.apply(plan.keys, plan.keep, plan.counts, plan.new_ids)
        assert [g.tolist() for g in got] == [r.tolist() for r in rows] == [r.block_ids for r in reqs], step
    assert len(rebuilds) == 2  # the first step and the replaced list; every other step took the fast path


def test_decode_frames_do_not_grow_with_context():
    sizes = {}
    for blocks in (4, 512):  # 64 and 8192 tokens of context per request
        reqs = _decode_batch(256, blocks)
        cache = BlockRows()
        cache.rows(reqs)  # the previous step: rows known
        for r in reqs:
            r.token_ids.append(1)
            r.num_computed_tokens += 1
        r = reqs[0]
        r.block_ids.append(99999)  # one request crossed into a new block
        delta = RowDelta()
        cache.rows(reqs, delta)
        sizes[blocks] = StepPlan.build("decode", 256, gather(reqs, [1] * 256), delta).encode(TAG_STEP).nbytes
    assert sizes[4] == sizes[512] == 8 * (1 + StepPlan.HEADER + 7 * 256 + 1)


def test_encoding_a_decode_step_takes_microseconds():
    reqs = _decode_batch(256, 128)
    cache = BlockRows()
    cache.rows(reqs)
    t = []
    for _ in range(50):
        t0 = time.perf_counter()
        delta = RowDelta()
        cache.rows(reqs, delta)
        StepPlan.build("decode", 256, gather(reqs, [1] * 256), delta).encode(TAG_STEP)
        t.append(time.perf_counter() - t0)
    # gathering the batch is rank 0's work at TP=1 too; the generous bound only catches an O(context) regression
    assert sorted(t)[len(t) // 2] < 5e-3, f"median {sorted(t)[len(t) // 2] * 1e6:.0f} us"

"""The push plan between tensor-parallel sizes: every head of every decode rank from exactly one prefill rank that
holds it, replicas spread over the holders, and the pair (0 -> 0) always present (it carries the first token)."""

from __future__ import annotations

import pytest

from pdserve.disagg.heads import HeadRun, head_ranges, push_plan


def test_head_ranges_split_or_replicate():
    assert head_ranges(8, 1) == [(0, 8)]
    assert head_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert head_ranges(1, 2) == [(0, 1), (0, 1)]  # Gemma 3 270M: every rank holds the one KV head
    assert head_ranges(2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize("heads,p,d,want", [
    (2, 1, 2, [HeadRun(0, 0, 0, 1), HeadRun(0, 1, 1, 2)]),
    (2, 2, 1, [HeadRun(0, 0, 0, 1), HeadRun(1, 0, 1, 2)]),
    (2, 2, 2, [HeadRun(0, 0, 0, 1), HeadRun(1, 1, 1, 2)]),
    (1, 2, 1, [HeadRun(0, 0, 0, 1)]),  # one copy suffices: rank 1 sends nothing
    (1, 1, 2, [HeadRun(0, 0, 0, 1), HeadRun(0, 1, 0, 1)]),  # the one head to both decode ranks
    (1, 2, 2, [HeadRun(0, 0, 0, 1), HeadRun(1, 1, 0, 1)]),  # replicas spread: each prefill rank sends once
    (8, 2, 4, [HeadRun(0, 0, 0, 2), HeadRun(0, 1, 2, 4), HeadRun(1, 2, 4, 6), HeadRun(1, 3, 6, 8)]),
    (8, 4, 2, [HeadRun(0, 0, 0, 2), HeadRun(1, 0, 2, 4), HeadRun(2, 1, 4, 6), HeadRun(3, 1, 6, 8)]),
])
def test_push_plan(heads, p, d, want):
    assert push_plan(head_ranges(heads, p), head_ranges(heads, d)) == want


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_every_destination_head_comes_once_from_a_holder(heads, p, d):
    if (p > heads and p % heads) or (d > heads and d % heads):
        pytest.skip("not a valid split")
    src, dst = head_ranges(heads, p), head_ranges(heads, d)
    runs = push_plan(src, dst)
    assert (runs[0].src, runs[0].dst, runs[0].lo) == (0, 0, 0)
    for r, (a, b) in enumerate(dst):
        got = sorted(h for run in runs if run.dst == r for h in range(run.lo, run.hi))
        assert got == list(range(a, b))
    for run in runs:
        assert src[run.src][0] <= run.lo < run.hi <= src[run.src][1]
    assert len({(r.src, r.dst) for r in runs}) == len(runs)  # one contiguous run per pair


def test_a_head_nobody_holds_is_refused():
    with pytest.raises(ValueError, match="held by no prefill rank"):
        push_plan([(0, 1)], [(0, 2)])

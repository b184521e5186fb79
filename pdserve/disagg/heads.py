"""Which prefill rank sends which KV heads to which decode rank, when the two instances' tensor-parallel sizes differ.

Each rank's pool holds a range of the model's KV heads (`pdserve.parallel.ranges.kv_head_range`): an even split, or,
with more ranks than KV heads, one replicated head per rank (Gemma 3 270M has one KV head: every rank holds it).
Blocks are head-major, so the bytes of a head range of one block are one contiguous run on both sides: a push is one
run per block and (source, destination) pair, or per head and layer when it goes layer by layer.

The plan: every head of every destination rank comes from exactly one source rank holding it; among replicas,
destination rank d takes the (d mod copies)-th holder, which spreads the sends and makes prefill rank 0 always send
head 0 to decode rank 0 (the pair whose notification carries the first token).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.parallel.ranges import RankOf, kv_head_range

MAX_TP = 64  # ranks an instance may have, as far as a peer's notification or destination may claim


@dataclass(frozen=True)
class HeadRun:
    """Global KV heads [lo, hi) go from source rank `src` to destination rank `dst`."""

    src: int
    dst: int
    lo: int
    hi: int


def head_ranges(num_kv_heads: int, tp_size: int) -> list[tuple[int, int]]:
    """The KV heads each rank of a `tp_size` instance holds, in rank order."""
    return [kv_head_range(num_kv_heads, RankOf(r, tp_size)) for r in range(tp_size)]


def push_plan(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> list[HeadRun]:
    """The runs that give every destination rank its heads, each from one source rank (ordered by destination,
    then head). Raises ValueError if a destination head is held by no source rank."""
    runs: list[HeadRun] = []
    for d, (a, b) in enumerate(dst):
        cur: HeadRun | None = None
        for h in range(a, b):
            holders = [s for s, (x, y) in enumerate(src) if x <= h < y]
            if not holders:
                raise ValueError(f"KV head {h} of decode rank {d} is held by no prefill rank ({src})")
            s = holders[d % len(holders)]
            if cur is not None and cur.src == s and cur.hi == h:
                cur = HeadRun(s, d, cur.lo, h + 1)
                runs[-1] = cur
            else:
                cur = HeadRun(s, d, h, h + 1)
                runs.append(cur)
    return runs

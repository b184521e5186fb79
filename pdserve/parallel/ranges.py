"""Which run of a tensor-parallel split a rank holds: arithmetic on (rank, size), without torch.

The HTTP frontend plans PD pushes by KV head (pdserve.disagg.heads) and so needs this; imported from the layers'
module, it pulled torch into the frontend before the engine process was even spawned, seconds of every start."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class Place(Protocol):
    rank: int
    size: int


class RankOf(NamedTuple):
    """A rank's place in a group of `size`, where no process group is needed (parallel.group.TPGroup has one)."""

    rank: int
    size: int


def even_range(total: int, tp: Place, what: str) -> tuple[int, int]:
    """This rank's run of `total` items split evenly (they must divide)."""
    if total % tp.size:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel size ({tp.size})")
    n = total // tp.size
    return tp.rank * n, (tp.rank + 1) * n


def kv_head_range(num_kv_heads: int, tp: Place) -> tuple[int, int]:
    """The KV heads this rank holds: an even split, or with more ranks than KV heads the one head its query heads
    share (the size must then be a multiple of the KV head count)."""
    if num_kv_heads >= tp.size:
        return even_range(num_kv_heads, tp, "the number of KV heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"the tensor-parallel size ({tp.size}) must be a multiple of the number of KV heads "
                         f"({num_kv_heads}) when it exceeds it")
    h = tp.rank * num_kv_heads // tp.size
    return h, h + 1


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads in each rank's pool at `tp_size` ranks."""
    return max(1, num_kv_heads // tp_size)

"""Descriptor lists: coalescing keeps the byte mapping, splitting keeps it, validation rejects what it must."""

import numpy as np
import pytest

from pdserve.kv.descs import XferList, block_xfers, validate, validate_side
from pdserve.kv.errors import InvalidDescriptorError


def byte_map(x: XferList) -> dict[tuple[int, int], tuple[int, int]]:
    """(local region, byte) -> (remote region, byte) for every byte the list moves (small lists only)."""
    m = {}
    for lr, lo, rr, ro, n in zip(x.local_region, x.local_offset, x.remote_region, x.remote_offset, x.length):
        for k in range(int(n)):
            key = (int(lr), int(lo) + k)
            assert key not in m
            m[key] = (int(rr), int(ro) + k)
    return m


@pytest.mark.parametrize("seed", range(5))
def test_coalesce_preserves_mapping_and_merges_runs(seed):
    rng = np.random.default_rng(seed)
    n = 40
    src = rng.permutation(60)[:n]
    # half the destinations continue the sources' runs, half are random
    dst = np.where(rng.random(n) < 0.5, src + 100, rng.permutation(60)[:n] + 200)
    x = block_xfers(src, dst, 8, 1, 2, coalesce=False)
    c = x.coalesce()
    assert byte_map(c) == byte_map(x)
    assert c.total_bytes == x.total_bytes == n * 8
    assert len(c) <= len(x)


def test_consecutive_blocks_merge_into_one_descriptor():
    x = block_xfers(np.arange(10, 20)[::-1], np.arange(50, 60)[::-1], 4096, 1, 1)
    assert len(x) == 1 and int(x.length[0]) == 10 * 4096
    assert int(x.local_offset[0]) == 10 * 4096 and int(x.remote_offset[0]) == 50 * 4096
    y = block_xfers([0, 1, 2, 5, 6], [3, 4, 9, 7, 8], 16, 1, 1)
    assert len(y) == 3  # (0,1)->(3,4), 2->9, (5,6)->(7,8)


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_bytes_partitions_the_mapping(parts):
    x = block_xfers([3, 9, 1, 4], [0, 5, 7, 2], 100, 1, 2)
    pieces = x.split_bytes(parts)
    merged = {}
    for p in pieces:
        merged.update(byte_map(p))
    assert merged == byte_map(x)
    sizes = [p.total_bytes for p in pieces]
    assert sum(sizes) == x.total_bytes and max(sizes) - min(sizes) <= 1


def test_block_xfers_rejects_bad_input():
    with pytest.raises(InvalidDescriptorError, match="3 source block ids but 2"):
        block_xfers([1, 2, 3], [1, 2], 16, 1, 1)
    with pytest.raises(InvalidDescriptorError, match="repeat"):
        block_xfers([1, 2], [5, 5], 16, 1, 1)
    with pytest.raises(InvalidDescriptorError, match="non-negative"):
        block_xfers([-1], [0], 16, 1, 1)


def test_validate_bounds_unknown_regions_and_overlap():
    sizes = {1: 1000, 2: 500}
    ok = XferList.from_tuples([(1, 0, 2, 0, 100), (1, 900, 2, 400, 100)])
    validate(ok, sizes, sizes, op="write")
    with pytest.raises(InvalidDescriptorError, match=r"remote descriptor 0: bytes \[450, 550\) fall outside region 2"):
        validate(XferList.from_tuples([(1, 0, 2, 450, 100)]), sizes, sizes, op="write")
    with pytest.raises(InvalidDescriptorError, match="unregistered region"):
        validate(XferList.from_tuples([(7, 0, 2, 0, 10)]), sizes, sizes, op="write")
    with pytest.raises(InvalidDescriptorError, match="overlap"):
        validate(XferList.from_tuples([(1, 0, 2, 0, 100), (1, 200, 2, 50, 100)]), sizes, sizes, op="write")
    with pytest.raises(InvalidDescriptorError, match="negative offset"):
        validate(XferList.from_tuples([(1, -8, 2, 0, 8)]), sizes, sizes, op="read")
    # for a READ the local side is the destination: overlaps there are rejected, on the remote side allowed
    validate(XferList.from_tuples([(1, 0, 2, 0, 100), (1, 200, 2, 50, 100)]), sizes, sizes, op="read")


def test_validate_refuses_lengths_that_overflow_int64():
    sizes = {2: 1 << 40}
    huge = (1 << 63) - 1  # offset + huge wraps around to a negative int64: the old check let it pass

    def side(off, n):
        validate_side(np.array([2]), np.array([off], dtype=np.int64), np.array([n], dtype=np.int64), sizes,
                      side="destination", check_overlap=True)

    for off in (1, 8, 999):
        with pytest.raises(InvalidDescriptorError, match="fall outside region 2"):
            side(off, huge)
    with pytest.raises(InvalidDescriptorError, match="fall outside region 2"):
        side(1 << 62, 1 << 62)
    side((1 << 40) - 10, 10)  # the region's last bytes: fine


def test_wire_descriptors_beyond_63_bits_are_refused():
    from pdserve.kv.wire import DESC, unpack_descs

    a = np.zeros(2, dtype=DESC)
    a["region"], a["offset"], a["length"] = 1, [0, 1 << 63], [8, 8]
    with pytest.raises(InvalidDescriptorError, match="63 bits"):
        unpack_descs(a.tobytes())
    a["offset"][1], a["length"][1] = 0, (1 << 64) - 1
    with pytest.raises(InvalidDescriptorError, match="63 bits"):
        unpack_descs(a.tobytes())
    with pytest.raises(InvalidDescriptorError, match="whole number"):
        unpack_descs(a.tobytes()[:-1])

"""Attention metadata: the prefill tile table, the one-copy builder (values, padding, static layout) and the lazy
backend registry."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pdserve.ops.attention import (
    PREFILL_TILE,
    AttentionMetadata,
    AttentionMetadataBuilder,
    get_backend,
    max_prefill_tiles,
    pack_block_tables,
    prefill_tile_table,
    register_backend,
)
from tests.ops.attention_helpers import gpu


def test_tile_table_covers_every_prefill_token_once_heaviest_first():
    q_lens = [1, 300, 2, 1, 129, 128]
    seq_lens = [50, 1300, 2, 9, 129, 5000]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    table = prefill_tile_table(qsl, np.array(seq_lens))
    covered = {}
    for row, first in table.tolist():
        for t in range(first, min(first + PREFILL_TILE, q_lens[row])):
            assert (row, t) not in covered
            covered[row, t] = True
    assert set(covered) == {(r, t) for r, q in enumerate(q_lens) if q > 1 for t in range(q)}
    work = [seq_lens[r] - q_lens[r] + min(f + PREFILL_TILE, q_lens[r]) for r, f in table.tolist()]
    assert work == sorted(work, reverse=True)
    assert len(table) <= max_prefill_tiles(int(qsl[-1]), 4)


def test_tile_table_padding_and_overflow():
    qsl = np.array([0, 200, 201])
    table = prefill_tile_table(qsl, np.array([200, 30]), pad_to=5)
    assert table.shape == (5, 2) and (table[2:, 0] == -1).all()
    with pytest.raises(ValueError):
        prefill_tile_table(qsl, np.array([200, 30]), pad_to=1)


def test_builder_values_and_padding():
    b = AttentionMetadataBuilder(torch.device("cpu"), max_tokens=64, max_seqs=8, max_blocks_per_seq=6)
    tables = [[4, 2], [7], [1, 3, 5]]
    qsl, lens, slots = [0, 1, 21, 30], [17, 20, 40], list(range(30))
    meta = b.build(qsl, lens, tables, slots, num_tokens=40, num_seqs=6)
    assert meta.query_start_loc == qsl and meta.seq_lens == lens and meta.max_seq_len == 40
    assert not meta.decode_only and meta.has_decodes
    assert meta.slot_mapping.tolist() == slots + [-1] * 10
    assert meta.seq_lens_t.tolist() == lens + [0, 0, 0]
    assert meta.query_start_loc_t.tolist() == qsl + [31, 32, 33]
    assert meta.block_tables.tolist() == [[4, 2, -1], [7, -1, -1], [1, 3, 5]] + [[-1] * 3] * 3
    tiles = meta.prefill_tiles.tolist()
    assert len(tiles) == max_prefill_tiles(40, 6)
    assert sorted(t for t in tiles if t[0] >= 0) == [[1, 0], [2, 0]] and all(t == [-1, 0] for t in tiles[2:])
    assert meta.seq_lens_t.dtype == meta.query_start_loc_t.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64


def test_builder_decode_only_and_static_width():
    b = AttentionMetadataBuilder(torch.device("cpu"), 16, 4, 8, static=True)
    meta = b.build([0, 1, 2], [5, 9], np.array([[3, -1], [6, 2]], dtype=np.int32), [13, 29])
    assert meta.decode_only and meta.any_decodes()
    assert meta.block_tables.shape == (2, 8)
    with pytest.raises(ValueError):
        b.build([0, 20], [20], [[1, 2]], list(range(20)))  # more tokens than the static buffers hold


def test_hand_built_metadata_gets_device_tensors_once():
    meta = AttentionMetadata([0, 3, 4], [3, 10], torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
                             torch.arange(4), 10, False)
    assert meta.any_decodes()
    meta.ensure_device(torch.device("cpu"))
    assert meta.seq_lens_t.tolist() == [3, 10] and meta.query_start_loc_t.tolist() == [0, 3, 4]
    assert meta.prefill_tiles.tolist() == [[0, 0]]
    tiles = meta.prefill_tiles
    meta.ensure_device(torch.device("cpu"))
    assert meta.prefill_tiles is tiles


def test_pack_block_tables():
    assert pack_block_tables([[1, 2], [], [3]]).tolist() == [[1, 2], [-1, -1], [3, -1]]
    assert pack_block_tables([[1]], width=3).tolist() == [[1, -1, -1]]


def test_registry_is_lazy_and_picks_torch_without_cuda():
    code = ("import sys; from pdserve.ops.attention import get_backend, AttentionMetadata; "
            "b = get_backend('torch', 'cpu'); assert 'triton' not in sys.modules, 'triton imported'; print(b.name)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "torch"
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError):
        get_backend("nope", "cpu")
    with pytest.raises(ValueError):
        register_backend("bad", "no_colon")
    register_backend("torch2", "pdserve.ops.attention.torch_ref:TorchAttentionBackend")
    assert get_backend("torch2", "cpu").name == "torch"


@gpu
def test_static_builder_keeps_addresses_and_uses_one_copy():
    dev = torch.device("cuda")
    b = AttentionMetadataBuilder(dev, max_tokens=256, max_seqs=16, max_blocks_per_seq=32, static=True)
    m1 = b.build([0, 1, 100], [7, 300], [[1], list(range(19))], list(range(100)), num_tokens=128, num_seqs=8)
    ptrs = [t.data_ptr() for t in (m1.slot_mapping, m1.seq_lens_t, m1.query_start_loc_t, m1.block_tables,
                                   m1.prefill_tiles)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        m2 = b.build([0, 50, 51, 52], [60, 3, 90], [[2, 3, 4, 5], [6], list(range(6))], list(range(52)),
                     num_tokens=128, num_seqs=8)
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(copies) == 1, [e.name for e in prof.events()]
    assert ptrs == [t.data_ptr() for t in (m2.slot_mapping, m2.seq_lens_t, m2.query_start_loc_t, m2.block_tables,
                                           m2.prefill_tiles)]
    assert m2.seq_lens_t[:3].tolist() == [60, 3, 90] and m2.block_tables[1, :2].tolist() == [6, -1]
    assert m2.prefill_tiles.shape == m1.prefill_tiles.shape


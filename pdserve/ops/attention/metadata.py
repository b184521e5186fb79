"""Attention metadata of one step: where each sequence's new tokens sit in the flat batch, how long its KV is, which
pool blocks hold it, where its new K/V go; and a builder that makes the device tensors from host (numpy) arrays with
one host-to-device copy.

Rows (sequences) with one new token are *decode rows*; rows with more are *prefill rows* (a whole prompt, or a chunk
on top of a prefix already in the pool). The prefill kernel walks a tile table: one entry per `PREFILL_TILE` new
tokens of each prefill row, heaviest first, so one launch covers every prefill row of a step and its grid comes
from the table's length (a static buffer size under CUDA graphs), never from a device value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PREFILL_TILE = 128  # query tokens per tile-table entry; a kernel program takes an entry or a power-of-2 part of it


@dataclass
class AttentionMetadata:
    """Everything a backend needs to write and attend one step. Built once per step, shared by every layer."""

    query_start_loc: list[int]  # [B+1] offsets of each sequence's new tokens in the flat batch (host)
    seq_lens: list[int]  # [B] KV length of each sequence after this step: cached + new tokens (host)
    block_tables: torch.Tensor  # [B, max_blocks] int32 on device, -1 padded
    slot_mapping: torch.Tensor  # [T] int64 on device: block_id * block_size + offset of each new token; < 0: skip
    max_seq_len: int  # an upper bound of seq_lens (sizes the decode kernel's split count)
    decode_only: bool  # every sequence has exactly one new token, sequence i at token row i
    seq_lens_t: torch.Tensor | None = None  # [B] int32 on device
    query_start_loc_t: torch.Tensor | None = None  # [B+1] int32 on device
    prefill_tiles: torch.Tensor | None = None  # [n, 2] int32 on device: (row, first new token), rows -1 = padding
    has_decodes: bool | None = None  # some row has exactly one new token (None: read query_start_loc)
    library: tuple | None = None  # (rows,) once the backend has asked which prefill rows a library kernel takes

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def any_decodes(self) -> bool:
        if self.has_decodes is None:
            qsl = self.query_start_loc
            self.has_decodes = any(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1))
        return self.has_decodes

    def ensure_device(self, device: torch.device) -> None:
        """Make the device tensors a hand-built metadata lacks (a few small copies, once: every layer shares them).
        Metadata from `AttentionMetadataBuilder` has them all; only that kind may be used under CUDA graph capture."""
        if self.seq_lens_t is None:
            self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)
        if self.decode_only:
            return
        if self.query_start_loc_t is None:
            self.query_start_loc_t = torch.tensor(self.query_start_loc, dtype=torch.int32, device=device)
        if self.prefill_tiles is None:
            table = prefill_tile_table(np.asarray(self.query_start_loc), np.asarray(self.seq_lens))
            self.prefill_tiles = torch.from_numpy(table).to(device)


def prefill_tile_table(query_start_loc: np.ndarray, seq_lens: np.ndarray, pad_to: int = 0) -> np.ndarray:
    """[max(n, pad_to), 2] int32: (row, first new token) for every `PREFILL_TILE` new tokens of each row with more
    than one new token, ordered by the KV length the tile's last query sees (longest first, so the longest programs
    start first); padding entries are (-1, 0). Numpy only: no per-token Python work."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = np.diff(qsl)
    rows = np.flatnonzero(q_lens > 1)
    per_row = (q_lens[rows] + PREFILL_TILE - 1) // PREFILL_TILE
    n = int(per_row.sum())
    if pad_to and n > pad_to:
        raise ValueError(f"{n} prefill tiles exceed the padded tile table ({pad_to})")
    row = np.repeat(rows, per_row)
    first = (np.arange(n) - np.repeat(np.cumsum(per_row) - per_row, per_row)) * PREFILL_TILE
    q_len = q_lens[row]
    keys = lens[row] - q_len + np.minimum(first + PREFILL_TILE, q_len)
    order = np.argsort(-keys, kind="stable")
    out = np.zeros((max(n, pad_to), 2), dtype=np.int32)
    out[:, 0] = -1
    out[:n, 0] = row[order]
    out[:n, 1] = first[order]
    return out


def max_prefill_tiles(num_tokens: int, max_prefill_seqs: int) -> int:
    """Upper bound of the tile-table length for `num_tokens` new tokens in at most `max_prefill_seqs` prefill rows."""
    return -(-num_tokens // PREFILL_TILE) + max(0, min(max_prefill_seqs, num_tokens // 2))


def pack_block_tables(tables: list[list[int]], width: int = 0) -> np.ndarray:
    """Ragged per-sequence block lists as one [B, width] int32 array, -1 padded (one slice assignment per row)."""
    width = width or max((len(t) for t in tables), default=1) or 1
    out = np.full((len(tables), width), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


_ALIGN = 16


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Layout:
    """Byte offsets of the regions of one step's metadata in the staging buffers."""

    def __init__(self, tokens: int, seqs: int, tiles: int, width: int):
        self.tokens, self.seqs, self.tiles, self.width = tokens, seqs, tiles, width
        self.slots = 0
        self.lens = _align(8 * tokens)
        self.qsl = self.lens + _align(4 * seqs)
        self.tile = self.qsl + _align(4 * (seqs + 1))
        self.table = self.tile + _align(8 * tiles)
        self.end = self.table + 4 * seqs * width


class AttentionMetadataBuilder:
    """Builds `AttentionMetadata` whose device tensors arrive with one host-to-device copy per step.

    Two pinned host buffers alternate (each guarded by the event of its last copy, so filling step n+1 never
    overwrites bytes step n's copy has not read). `static=True` fixes every region's place by the maxima given here
    and the block-table width at `max_blocks_per_seq`, so the same padded sizes always give tensors at the same
    device addresses with the same strides: what CUDA graph replays need. Padded rows have KV length 0 and one
    padded token each (while padded tokens last), padded tokens have slot -1 (nothing written), padded tile entries
    are skipped: padding costs almost nothing and touches no pool block.
    """

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 max_prefill_seqs: int | None = None, static: bool = False):
        self.device = torch.device(device)
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.max_prefill_seqs = max_seqs if max_prefill_seqs is None else max_prefill_seqs
        self.static = static
        self._cuda = self.device.type == "cuda"
        full = _Layout(max_tokens, max_seqs, max_prefill_tiles(max_tokens, self.max_prefill_seqs), max_blocks_per_seq)
        self._static_layout = full
        self._alloc(full.end)
        self._slot = 0

    def _alloc(self, nbytes: int) -> None:
        self.capacity = nbytes
        self._hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device) if self._cuda else None

    def build(self, query_start_loc, seq_lens, block_tables, slot_mapping, *, num_tokens: int = 0,
              num_seqs: int = 0, num_tiles: int = 0, max_seq_len: int = 0) -> AttentionMetadata:
        """query_start_loc [B+1], seq_lens [B], block_tables [B, w] (array, or ragged lists of block ids),
        slot_mapping [T]: host arrays of the real rows. num_tokens / num_seqs / num_tiles pad the token count, the
        row count and the tile table (CUDA graph sizes; a padded build reports has_decodes=True so the decode
        kernel is always launched); max_seq_len: the KV-length bound the decode kernel splits by (default: the
        longest row)."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        slots = np.asarray(slot_mapping, dtype=np.int64)
        if not isinstance(block_tables, np.ndarray):
            block_tables = pack_block_tables(block_tables)
        b, t = len(lens), int(qsl[-1])
        if len(qsl) != b + 1 or len(slots) != t:
            raise ValueError(f"metadata of {b} rows needs {b + 1} query offsets and {t} slots")
        padded = bool(num_tokens or num_seqs or num_tiles)
        t_pad, b_pad = max(t, num_tokens), max(b, num_seqs)
        q_lens = np.diff(qsl)
        tiles = prefill_tile_table(qsl, lens)
        n_tiles = len(tiles)
        if padded:
            n_tiles = max(num_tiles or max_prefill_tiles(t_pad, min(b_pad, self.max_prefill_seqs)), n_tiles)
        width = self.max_blocks if self.static else max(1, block_tables.shape[1])
        if block_tables.shape[1] > width:
            raise ValueError(f"block tables of width {block_tables.shape[1]} exceed max_blocks_per_seq={width}")
        if self.static:
            lay = self._static_layout
            if t_pad > lay.tokens or b_pad > lay.seqs or n_tiles > lay.tiles:
                raise ValueError(f"step of {t_pad} tokens, {b_pad} rows, {n_tiles} tiles exceeds the static "
                                 f"metadata buffers ({lay.tokens}, {lay.seqs}, {lay.tiles})")
        else:
            lay = _Layout(t_pad, b_pad, n_tiles, width)
            if lay.end > self.capacity:
                self._sync_all()
                self._alloc(max(lay.end, 2 * self.capacity))
        self._slot ^= 1
        ev = self._events[self._slot]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer has finished
        host = self._hosts[self._slot].numpy()

        def region(off: int, dtype, shape):
            n = int(np.prod(shape))
            return host[off: off + n * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

        h_slots = region(lay.slots, np.int64, (t_pad,))
        h_slots[:t] = slots
        h_slots[t:] = -1
        h_lens = region(lay.lens, np.int32, (b_pad,))
        h_lens[:b] = lens
        h_lens[b:] = 0
        h_qsl = region(lay.qsl, np.int32, (b_pad + 1,))
        h_qsl[: b + 1] = qsl
        h_qsl[b + 1:] = np.minimum(t + np.arange(1, b_pad - b + 1), t_pad)  # one padded token per padded row
        h_tiles = region(lay.tile, np.int32, (n_tiles, 2))
        h_tiles[: len(tiles)] = tiles
        h_tiles[len(tiles):, 0] = -1
        h_tiles[len(tiles):, 1] = 0
        h_table = region(lay.table, np.int32, (b_pad, width))
        h_table[:b, : block_tables.shape[1]] = block_tables
        h_table[:b, block_tables.shape[1]:] = -1
        h_table[b:] = -1
        nbytes = lay.table + 4 * b_pad * width
        if self._cuda:
            dev = self._dev
            dev[:nbytes].copy_(self._hosts[self._slot][:nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._slot] = ev
        else:
            dev = self._hosts[self._slot][:nbytes].clone()

        def view(off: int, dtype, shape):
            n = int(np.prod(shape))
            return dev[off: off + n * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)

        decode_only = bool((q_lens == 1).all()) and t_pad == b_pad
        return AttentionMetadata(
            query_start_loc=qsl.tolist(),
            seq_lens=lens.tolist(),
            block_tables=view(lay.table, torch.int32, (b_pad, width)),
            slot_mapping=view(lay.slots, torch.int64, (t_pad,)),
            max_seq_len=int(max_seq_len or (lens.max() if b else 0)),
            decode_only=decode_only,
            seq_lens_t=view(lay.lens, torch.int32, (b_pad,)),
            query_start_loc_t=view(lay.qsl, torch.int32, (b_pad + 1,)),
            prefill_tiles=view(lay.tile, torch.int32, (n_tiles, 2)),
            has_decodes=True if padded else bool((q_lens == 1).any()),
        )

    def _sync_all(self) -> None:
        for ev in self._events:
            if ev is not None:
                ev.synchronize()

"""A step's integer inputs (token ids, positions, KV slots, sequence lengths, query offsets, block tables, the rows
to sample) built with numpy into a persistent pinned host buffer and sent to the device with one copy.

No per-token Python loops: per-request work is one list slice for the new token ids and one row of the block
table; positions, slots and offsets are numpy array arithmetic. Two host buffers alternate, each guarded by the
event of its last copy, so preparing step n+1 never overwrites bytes step n's copy has not read yet.

Tensor parallelism: every rank builds the same inputs from the same few per-request arrays (`StepArrays`) and
block-table rows. Rank 0 gathers them from its requests (`gather`, `BlockRows`) and sends them to the other ranks as
one `StepPlan` — a flat int64 buffer whose block tables travel as changes since the previous step (`RowDelta`,
replayed by each rank's `RowMirror`), so a decode step sends O(batch) integers whatever the context lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.ops.attention import prefill_tile_table

_NP = {torch.int64: np.int64, torch.int32: np.int32}
_SIZE = {torch.int64: 8, torch.int32: 4}
# Every region starts on 16 bytes: Triton specializes a pointer argument on whether its address is a multiple of 16,
# so regions that landed on 8 or 16 by the sizes before them made each kernel reading them compile again whenever a
# step's sizes flipped it (an H200 server compiled the attention kernels 19 times in its first 1024/1024 c256 run,
# 16 s in all, inside the first wave: benchmarks/lease_s8).
ALIGN = 16


class Staging:
    """Pinned host buffers and one device buffer of bytes; `alloc` carves aligned typed regions in order, so the
    same sequence of sizes always lands at the same device addresses (CUDA graphs read them there)."""

    def __init__(self, device: torch.device, capacity: int, growable: bool = True):
        self.device = device
        self.growable = growable
        self._on_cpu = device.type != "cuda"
        self._alloc_buffers(max(capacity, 64))
        self._slot = 0
        self._off = 0

    def _alloc_buffers(self, capacity: int) -> None:
        self.capacity = capacity
        pin = not self._on_cpu
        self._hosts = [torch.empty(capacity, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._hosts]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._dev = None if self._on_cpu else torch.empty(capacity, dtype=torch.uint8, device=self.device)

    def begin(self, nbytes: int) -> None:
        """Start a step that needs at most `nbytes` (alignment included)."""
        if nbytes > self.capacity:
            if not self.growable:
                raise ValueError(f"step inputs need {nbytes} bytes; the fixed staging buffer has {self.capacity}")
            for ev in self._events:
                if ev is not None:
                    ev.synchronize()
            self._alloc_buffers(max(nbytes, 2 * self.capacity))
        self._slot ^= 1
        ev = self._events[self._slot]
        if ev is not None:
            ev.synchronize()  # that buffer's last copy has been read (at once, unless the GPU is two steps behind)
        self._off = 0

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """A region for `shape`: (host numpy view to fill, device tensor it will arrive in)."""
        n = 1
        for d in shape:
            n *= d
        size = n * _SIZE[dtype]
        off = (self._off + ALIGN - 1) & ~(ALIGN - 1)
        end = off + size
        if end > self.capacity:
            raise ValueError("step inputs outgrew the staging buffer (size computed too small)")
        self._off = end
        host = self._host_np[self._slot][off:end].view(_NP[dtype]).reshape(shape)
        src = self._hosts[self._slot] if self._on_cpu else self._dev
        return host, src[off:end].view(dtype).view(shape)

    def commit(self) -> None:
        """One host-to-device copy of every region of this step."""
        if self._on_cpu:
            return
        self._dev[: self._off].copy_(self._hosts[self._slot][: self._off], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[self._slot] = ev


class BlockRows:
    """Each request's block ids as a numpy row, extended as its list grows, so a step converts only new ids.

    Relies on how the KV manager changes `req.block_ids`: in place it only appends (extend); anything else
    (prefix hits, frees, preemption, handovers) assigns a new list. Each entry holds the request and its list, so
    neither identity can be reused while cached; the last cached id is re-checked anyway. Entries live for
    one step: requests missing from a batch are dropped and rebuilt when they return.
    """

    def __init__(self) -> None:
        self._rows: dict[int, tuple[Request, list[int], np.ndarray, int]] = {}

    def rows(self, reqs: list[Request], delta: RowDelta | None = None) -> list[np.ndarray]:
        """The batch's rows; with `delta`, also records them as changes since the previous call (for RowMirror)."""
        new: dict[int, tuple[Request, list[int], np.ndarray, int]] = {}
        out = []
        for r in reqs:
            lst = r.block_ids
            m = len(lst)
            e = self._rows.get(id(r))
            if e is not None and e[0] is r and e[1] is lst and e[3] <= m and (not e[3] or lst[e[3] - 1] ==
                                                                             e[2][e[3] - 1]):
                arr, n = e[2], e[3]
                if m > n:
                    arr = _room(arr, n, m)
                    arr[n:m] = lst[n:m]
            else:
                arr, n = np.empty(max(16, 2 * m), dtype=np.int32), 0
                arr[:m] = lst
            new[id(r)] = (r, lst, arr, m)
            out.append(arr[:m])
            if delta is not None:
                delta.keys.append(id(r))
                delta.keep.append(n)
                delta.counts.append(m - n)
                if m > n:
                    delta.new.append(arr[n:m])
        self._rows = new
        return out


def _room(arr: np.ndarray, n: int, m: int) -> np.ndarray:
    """`arr` with its first n entries and room for m (grown by doubling)."""
    if m <= arr.shape[0]:
        return arr
    return np.concatenate([arr[:n], np.empty(max(m, 2 * arr.shape[0]) - n, dtype=np.int32)])


class RowDelta:
    """A step's block-table rows as changes: per request its key, how many entries of its previous row stay
    (0: a new row) and the entries after them."""

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.keep: list[int] = []
        self.counts: list[int] = []
        self.new: list[np.ndarray] = []



class RowMirror:
    """Another rank's copy of rank 0's BlockRows, rebuilt from each step's RowDelta. Like BlockRows it keeps the
    rows of the last step only, so both forget a request that leaves a batch at the same step."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[np.ndarray, int]] = {}
        self._keys = np.empty(0, dtype=np.int64)  # the last step's requests, its row lengths and rows
        self._lens = np.empty(0, dtype=np.int64)
        self._out: list[np.ndarray] = []

    def apply(self, keys: np.ndarray, keep: np.ndarray, counts: np.ndarray, new_ids: np.ndarray) -> list[np.ndarray]:
        if len(keys) == len(self._keys) and np.array_equal(keys, self._keys) and np.array_equal(keep, self._lens):
            return self._grow(keys, counts, new_ids)  # steady decoding: only the rows that grew change
        out = self._rebuild(keys, keep, counts, new_ids)
        self._keys, self._lens, self._out = keys.copy(), keep + counts, out
        return list(out)

    def _grow(self, keys: np.ndarray, counts: np.ndarray, new_ids: np.ndarray) -> list[np.ndarray]:
        grown = np.flatnonzero(counts)
        if len(grown):
            ends = np.cumsum(counts)
            for i, c, e in zip(grown.tolist(), counts[grown].tolist(), ends[grown].tolist()):
                key = int(keys[i])
                arr, n = self._rows[key]
                arr = _room(arr, n, n + c)
                arr[n : n + c] = new_ids[e - c : e]
                self._rows[key] = (arr, n + c)
                self._out[i] = arr[: n + c]
            self._lens = self._lens + counts
        return list(self._out)

    def _rebuild(self, keys: np.ndarray, keep: np.ndarray, counts: np.ndarray,
                 new_ids: np.ndarray) -> list[np.ndarray]:
        new: dict[int, tuple[np.ndarray, int]] = {}
        out = []
        off = 0
        for key, n, c in zip(keys.tolist(), keep.tolist(), counts.tolist()):
            m = n + c
            if n:
                arr, had = self._rows[key]
                if had < n:
                    raise RuntimeError(f"block-table mirror out of step: keeps {n} entries of a row of {had}")
                arr = _room(arr, n, m)
            else:
                arr = np.empty(max(16, 2 * m), dtype=np.int32)
            arr[n:m] = new_ids[off : off + c]
            off += c
            new[key] = (arr, m)
            out.append(arr[:m])
        self._rows = new
        return out


def layout_bytes(n_ids: int, n_slots: int, n_rows: int, width: int, n_sample: int, n_tiles: int = 0,
                 n_patch: int = 0) -> int:
    """Upper bound of the bytes `fill` takes (9 regions, each aligned to ALIGN bytes)."""
    return (8 * (2 * n_ids + n_slots + n_sample + 2 * n_patch) + 4 * (n_rows + (n_rows + 1) + n_rows * width
                                                                       + 2 * n_tiles) + ALIGN * 9)


@dataclass
class StepInputs:
    """Device tensors of one step and the host values attention metadata keeps as lists."""

    ids: torch.Tensor  # [n_ids] int64 (padded rows: token 0)
    positions: torch.Tensor  # [n_ids] int64 (padded rows: position 0)
    slots: torch.Tensor  # [n_slots] int64
    seq_lens_t: torch.Tensor  # [n_rows] int32
    qsl_t: torch.Tensor  # [n_rows + 1] int32
    block_tables: torch.Tensor  # [n_rows, width] int32
    sample_idx: torch.Tensor  # [num sampled] int64: rows of the flat batch whose logits are sampled
    prefill_tiles: torch.Tensor | None  # [n, 2] int32: the prefill kernel's work list (None: decode only)
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    sample_reqs: list[Request]  # rank 0 only (`fill`); other ranks have no Request objects
    num_tokens: int  # real tokens (T)
    decode_only: bool
    num_sampled: int  # rows whose logits are sampled (every rank)


@dataclass
class StepArrays:
    """A step's per-request integers, the same on every rank: what the inputs are built from."""

    ids: np.ndarray  # [T] int64: the new tokens, request after request
    starts: np.ndarray  # [B] int64: tokens already in the KV cache
    num_new: np.ndarray  # [B] int64
    sampled: np.ndarray  # [B] bool: the row reaches the end of the request's known tokens (its logits are sampled)


def gather(reqs: list[Request], num_new: list[int]) -> StepArrays:
    """Rank 0: the batch's arrays from its requests."""
    b = len(reqs)
    n = np.asarray(num_new, dtype=np.int64).reshape(b)
    starts = [r.num_computed_tokens for r in reqs]
    start = np.asarray(starts, dtype=np.int64).reshape(b)
    t = int(n.sum())
    if t == b:  # decode rows: one token each
        ids = np.fromiter((r.token_ids[s] for r, s in zip(reqs, starts)), dtype=np.int64, count=t)
    else:
        ids = np.fromiter(chain.from_iterable(r.token_ids[s : s + k] for r, s, k in zip(reqs, starts, num_new)),
                          dtype=np.int64, count=t)
    sampled = (start + n) == np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=b)
    return StepArrays(ids, start, n, sampled)


STEP_KINDS = ("eager", "decode", "mixed")  # how the forward runs: eagerly, a full decode graph, piecewise graphs


@dataclass
class StepPlan:
    """What rank 0 sends every other tensor-parallel rank each step: how to run it (kind, padded size) and its
    arrays, block tables as a RowDelta. Travels as one flat int64 buffer (`encode` / `decode`).

    `share_tokens`: after the forward, rank 0 broadcasts the step's sampled ids and every rank keeps them, so
    placeholder ids of the next step (async scheduling) are filled on each rank's own device."""

    kind: str
    size: int
    arrays: StepArrays
    keys: np.ndarray  # [B] int64
    keep: np.ndarray  # [B] int64
    counts: np.ndarray  # [B] int64
    new_ids: np.ndarray  # [sum(counts)]
    share_tokens: bool = False

    HEADER = 6  # kind, size, B, T, sum(counts), share_tokens

    @classmethod
    def build(cls, kind: str, size: int, arrays: StepArrays, delta: RowDelta, share_tokens: bool = False) -> StepPlan:
        new = np.concatenate(delta.new) if delta.new else np.empty(0, dtype=np.int32)
        return cls(kind, size, arrays, np.asarray(delta.keys, dtype=np.int64), np.asarray(delta.keep, dtype=np.int64),
                   np.asarray(delta.counts, dtype=np.int64), new, share_tokens)

    def encode(self, prefix: int) -> np.ndarray:
        """[prefix, header..., starts, num_new, sampled, keys, keep, counts, ids, new_ids] as int64."""
        a = self.arrays
        b, t, s = len(a.starts), len(a.ids), len(self.new_ids)
        buf = np.empty(1 + self.HEADER + 6 * b + t + s, dtype=np.int64)
        buf[: 1 + self.HEADER] = (prefix, STEP_KINDS.index(self.kind), self.size, b, t, s, int(self.share_tokens))
        o = 1 + self.HEADER
        for arr in (a.starts, a.num_new, a.sampled, self.keys, self.keep, self.counts):
            buf[o : o + b] = arr
            o += b
        buf[o : o + t] = a.ids
        buf[o + t :] = self.new_ids
        return buf

    @classmethod
    def decode(cls, buf: np.ndarray) -> StepPlan:
        """From `encode`'s buffer without its prefix (views into `buf`)."""
        kind, size, b, t, s, share = (int(x) for x in buf[: cls.HEADER])
        o = cls.HEADER
        cols = [buf[o + i * b : o + (i + 1) * b] for i in range(6)]
        o += 6 * b
        arrays = StepArrays(buf[o : o + t], cols[0], cols[1], cols[2].astype(bool))
        return cls(STEP_KINDS[kind], size, arrays, cols[3], cols[4], cols[5], buf[o + t : o + t + s], bool(share))


def fill(staging: Staging, reqs: list[Request], num_new: list[int], block_size: int, *,
         block_rows: BlockRows | None = None, **pads) -> StepInputs:
    """Build a step's inputs from its requests into `staging` and send them (one copy); see `fill_arrays`."""
    arrays = gather(reqs, num_new)
    rows = block_rows.rows(reqs) if block_rows is not None else [r.block_ids for r in reqs]
    inp = fill_arrays(staging, arrays, rows, block_size, **pads)
    inp.sample_reqs = [r for r, s in zip(reqs, arrays.sampled.tolist()) if s]
    return inp


def fill_arrays(staging: Staging, a: StepArrays, rows: list, block_size: int, *, pad_ids: int = 0,
                pad_rows: int = 0, width: int = 0, pad_slot: int = 0, pad_block: int = -1,
                slots_padded: bool = False, prev_tokens: torch.Tensor | None = None) -> StepInputs:
    """Build a step's inputs into `staging` and send them (one copy). `rows`: each request's block ids.

    Placeholders (async scheduling): a negative id -(j + 1) stands for the token sampled in row j of the previous
    step, not yet on the host; it is taken from `prev_tokens` (that step's sampled ids, on the device) by one
    gather on the device after the copy, so building the inputs never waits for the previous step.

    pad_ids: token rows to pad ids/positions to (CUDA graph sizes); pad_rows: sequence rows to pad lengths and
    tables to (decode graphs); width: block-table width (0: the batch's longest); pad_slot / pad_block: the
    scratch slot and block padded rows point at; slots_padded: pad the slot mapping like the ids (decode graphs).
    """
    n, start, sampled = a.num_new, a.starts, a.sampled
    b = len(n)
    end = start + n
    t = len(a.ids)
    nblk = [len(x) for x in rows]
    width = width or max(1, max(nblk, default=1))
    n_ids = max(t, pad_ids)
    n_rows = max(b, pad_rows)
    n_slots = n_ids if slots_padded else t
    n_sample = int(sampled.sum())
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    decode_only = bool((n == 1).all())
    tiles = None if decode_only else prefill_tile_table(qsl, end)
    ph = np.flatnonzero(a.ids < 0)
    n_patch = len(ph)
    staging.begin(layout_bytes(n_ids, n_slots, n_rows, width, n_sample, 0 if tiles is None else len(tiles),
                               n_patch))

    ids_h, ids_d = staging.alloc((n_ids,), torch.int64)
    pos_h, pos_d = staging.alloc((n_ids,), torch.int64)
    slot_h, slot_d = staging.alloc((n_slots,), torch.int64)
    lens_h, lens_d = staging.alloc((n_rows,), torch.int32)
    qsl_h, qsl_d = staging.alloc((n_rows + 1,), torch.int32)
    tab_h, tab_d = staging.alloc((n_rows, width), torch.int32)
    samp_h, samp_d = staging.alloc((n_sample,), torch.int64)
    tiles_d = None
    if tiles is not None:
        tiles_h, tiles_d = staging.alloc(tiles.shape, torch.int32)
        tiles_h[:] = tiles
    ids_h[:t] = a.ids
    ids_h[t:] = 0
    pos = np.arange(t, dtype=np.int64) + np.repeat(start - qsl[:-1], n)
    pos_h[:t] = pos
    pos_h[t:] = 0
    tab_h.fill(pad_block)
    for i, row in enumerate(rows):
        tab_h[i, : nblk[i]] = row
    slot_h[:t] = tab_h[np.repeat(np.arange(b), n), pos // block_size].astype(np.int64) * block_size + pos % block_size
    slot_h[t:] = pad_slot
    lens_h[:b] = end
    lens_h[b:] = 1
    qsl_h[: b + 1] = qsl
    qsl_h[b + 1 :] = np.arange(t + 1, t + 1 + n_rows - b)  # padded rows: one token each
    samp_h[:] = qsl[1:][sampled] - 1
    if n_patch:
        if prev_tokens is None:
            raise RuntimeError("step inputs hold placeholders but no previous step's tokens were given")
        patch_h, patch_d = staging.alloc((2, n_patch), torch.int64)
        patch_h[0] = ph
        patch_h[1] = -a.ids[ph] - 1
        ids_h[ph] = 0
    staging.commit()
    if n_patch:
        ids_d.index_copy_(0, patch_d[0], prev_tokens.index_select(0, patch_d[1]))
    return StepInputs(ids_d, pos_d, slot_d, lens_d, qsl_d, tab_d, samp_d, tiles_d, qsl.tolist(), end.tolist(), [],
                      t, decode_only, n_sample)

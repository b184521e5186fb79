"""A step's integer inputs (token ids, positions, KV slots, sequence lengths, query offsets, block tables, the rows
to sample) built with numpy into a persistent pinned host buffer and sent to the device with one copy.

No per-token Python loops: per-request work is one list slice for the new token ids and one row of the block
table; positions, slots and offsets are numpy array arithmetic. Two host buffers alternate, each guarded by the
event of its last copy, so preparing step n+1 never overwrites bytes step n's copy has not read yet.
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
        off = (self._off + 7) & ~7
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

    def rows(self, reqs: list[Request]) -> list[np.ndarray]:
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
                    if m > arr.shape[0]:
                        arr = np.concatenate([arr[:n], np.empty(max(m, 2 * arr.shape[0]) - n, dtype=np.int32)])
                    arr[n:m] = lst[n:m]
            else:
                arr = np.empty(max(16, 2 * m), dtype=np.int32)
                arr[:m] = lst
            new[id(r)] = (r, lst, arr, m)
            out.append(arr[:m])
        self._rows = new
        return out


def layout_bytes(n_ids: int, n_slots: int, n_rows: int, width: int, n_sample: int, n_tiles: int = 0) -> int:
    """Upper bound of the bytes `fill` takes (8 regions, each aligned to 8 bytes)."""
    return 8 * (2 * n_ids + n_slots + n_sample) + 4 * (n_rows + (n_rows + 1) + n_rows * width + 2 * n_tiles) + 8 * 8


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
    sample_reqs: list[Request]
    num_tokens: int  # real tokens (T)
    decode_only: bool


def fill(staging: Staging, reqs: list[Request], num_new: list[int], block_size: int, *, pad_ids: int = 0,
         pad_rows: int = 0, width: int = 0, pad_slot: int = 0, pad_block: int = -1,
         slots_padded: bool = False, block_rows: BlockRows | None = None) -> StepInputs:
    """Build a step's inputs into `staging` and send them (one copy).

    pad_ids: token rows to pad ids/positions to (CUDA graph sizes); pad_rows: sequence rows to pad lengths and
    tables to (decode graphs); width: block-table width (0: the batch's longest); pad_slot / pad_block: the
    scratch slot and block padded rows point at; slots_padded: pad the slot mapping like the ids (decode graphs).
    """
    b = len(reqs)
    n = np.asarray(num_new, dtype=np.int64)
    starts = [r.num_computed_tokens for r in reqs]
    start = np.asarray(starts, dtype=np.int64)
    end = start + n
    t = int(n.sum())
    rows = block_rows.rows(reqs) if block_rows is not None else [r.block_ids for r in reqs]
    nblk = [len(x) for x in rows]
    width = width or max(1, max(nblk, default=1))
    n_ids = max(t, pad_ids)
    n_rows = max(b, pad_rows)
    n_slots = n_ids if slots_padded else t
    sampled = end == np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=b)
    n_sample = int(sampled.sum())
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    decode_only = bool((n == 1).all())
    tiles = None if decode_only else prefill_tile_table(qsl, end)
    staging.begin(layout_bytes(n_ids, n_slots, n_rows, width, n_sample, 0 if tiles is None else len(tiles)))

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
    if t == b:  # decode rows: one token each
        ids_h[:t] = [r.token_ids[s] for r, s in zip(reqs, starts)]
    else:
        ids_h[:t] = np.fromiter(chain.from_iterable(r.token_ids[s : s + k] for r, s, k in zip(reqs, starts, num_new)),
                                dtype=np.int64, count=t)
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
    staging.commit()
    return StepInputs(ids_d, pos_d, slot_d, lens_d, qsl_d, tab_d, samp_d, tiles_d, qsl.tolist(), end.tolist(),
                      [r for r, s in zip(reqs, sampled.tolist()) if s], t, decode_only)

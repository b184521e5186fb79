"""Grants: which bytes of our registered memory a peer may write or read, for which request, until when.

The receiving engine reserves blocks for one request from one peer and grants exactly those byte ranges ("w"); a
prefill engine that lets a decode peer pull its blocks exports them ("r"). Every incoming descriptor of a transfer
is checked against the live grants of the transfer's key (the request id) before a byte moves, and notifications
for a key are delivered only from a peer that key's grants admit. Grants end at their deadline or at `revoke`.

Deadlines are wall-clock `time.time()` values, like the engine's leases. A deadline in the past or more than
`max_ahead_s` ahead is refused at once, so passing a `time.monotonic()` value by mistake fails loudly.
Thread-safe: the engine grants from its own thread while the agent's loop checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.kv.wire import MAX_KEY_BYTES

MODES = ("w", "r")
_OP_MODE = {"write": "w", "read": "r"}
MAX_RANGES = 1 << 20


@dataclass(frozen=True)
class Grant:
    key: str
    region: int
    starts: np.ndarray  # sorted, merged byte ranges [starts[i], ends[i])
    ends: np.ndarray
    mode: str
    deadline: float
    peer: str | None

    def admits(self, peer: str, now: float) -> bool:
        return self.deadline > now and (self.peer is None or self.peer == peer)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    known: bool  # the key has a live grant admitting this peer (a refusal is then reported for the key)
    why: str = ""


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"a grant key must be a non-empty str of at most {MAX_KEY_BYTES} bytes")
    return key


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of ranges as sorted, disjoint, non-adjacent ranges."""
    if starts.size <= 1:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    return s[first], np.maximum.reduceat(e, first)


def parse_ranges(ranges: Sequence[tuple[int, int]] | np.ndarray, region_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(offset, length) pairs inside a region of `region_size` bytes, merged; ValueError for anything else."""
    try:
        a = np.asarray(ranges, dtype=np.int64)
    except (OverflowError, ValueError, TypeError) as e:
        raise ValueError(f"grant ranges must be (offset, length) integer pairs: {e}") from None
    if a.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError(f"grant ranges must be (offset, length) pairs, got an array of shape {a.shape}")
    if a.shape[0] > MAX_RANGES:
        raise ValueError(f"{a.shape[0]} grant ranges; at most {MAX_RANGES}")
    off, n = a[:, 0], a[:, 1]
    if (off < 0).any() or (n <= 0).any():
        raise ValueError("grant ranges need offsets >= 0 and lengths > 0")
    if (off > region_size).any() or (n > region_size - off).any():  # no offset + length: it could wrap around
        i = int(np.flatnonzero((off > region_size) | (n > region_size - off))[0])
        raise ValueError(f"grant range ({int(off[i])}, {int(n[i])}) exceeds the region's {region_size} bytes")
    return _merge(off, off + n)


class Grants:
    def __init__(self, max_keys: int, max_ahead_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_keys, self.max_ahead_s, self.clock = max_keys, max_ahead_s, clock
        self._lock = threading.Lock()
        self._by_key: dict[str, list[Grant]] = {}
        self._active: dict[str, int] = {}
        self._purge_at = 64

    def add(self, key: str, region: int, region_size: int, ranges: Sequence[tuple[int, int]] | np.ndarray,
            mode: str, deadline: float, peer: str | None = None) -> Grant:
        check_key(key)
        if mode not in MODES:
            raise ValueError(f"grant mode must be 'w' or 'r', got {mode!r}")
        if peer is not None and not isinstance(peer, str):
            raise ValueError("grant peer must be an agent name or None")
        now = self.clock()
        deadline = float(deadline)
        if not deadline > now:
            raise ValueError(f"grant deadline {deadline:.3f} is not in the future (now {now:.3f}; deadlines are "
                             "time.time() values)")
        if deadline > now + self.max_ahead_s:
            raise ValueError(f"grant deadline lies {deadline - now:.0f} s ahead, more than max_grant_s="
                             f"{self.max_ahead_s:g} (deadlines are time.time() values)")
        starts, ends = parse_ranges(ranges, region_size)
        g = Grant(key, int(region), starts, ends, mode, deadline, peer)
        with self._lock:
            if key not in self._by_key and len(self._by_key) >= self._purge_at:
                self._purge(now)
            if key not in self._by_key and len(self._by_key) >= self.max_keys:
                raise ValueError(f"{len(self._by_key)} live grant keys: the limit (max_grants) is reached; "
                                 "revoke finished requests")
            self._by_key.setdefault(key, []).append(g)
        return g

    def _purge(self, now: float) -> None:
        for k in [k for k, gs in self._by_key.items() if all(g.deadline <= now for g in gs)]:
            del self._by_key[k]
        self._purge_at = max(64, 2 * len(self._by_key))

    def revoke(self, key: str) -> int:
        """Drop every grant of `key`; returns how many incoming copies under it are still running (a copy that
        passed its check before the revoke finishes; one-sided transports are not counted: see the README)."""
        with self._lock:
            self._by_key.pop(key, None)
            return self._active.get(key, 0)

    def live(self, key: str) -> list[Grant]:
        now = self.clock()
        with self._lock:
            return [g for g in self._by_key.get(key, ()) if g.deadline > now]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def check(self, key: str | None, peer: str, op: str, region: np.ndarray, offset: np.ndarray,
              length: np.ndarray) -> Verdict:
        """Whether `peer` may `op` ('write' into / 'read' from our memory) every descriptor under `key`.
        Offsets and lengths must already be validated against the regions (non-negative, inside)."""
        if key is None:
            return Verdict(False, False, "the transfer carries no key; this agent only accepts transfers under a "
                                         "grant (pass key=<request id>)")
        mode = _OP_MODE[op]
        now = self.clock()
        with self._lock:
            gs = [g for g in self._by_key.get(key, ()) if g.admits(peer, now)]
        known = bool(gs)
        gs = [g for g in gs if g.mode == mode]
        if not gs:
            return Verdict(False, known, f"no live '{mode}' grant for key {key!r} admits peer {peer!r}")
        ok = np.zeros(region.size, dtype=bool)
        for r in np.unique(region).tolist() if region.size else []:
            mine = [g for g in gs if g.region == r]
            if not mine:
                continue
            starts = np.concatenate([g.starts for g in mine]) if len(mine) > 1 else mine[0].starts
            ends = np.concatenate([g.ends for g in mine]) if len(mine) > 1 else mine[0].ends
            starts, ends = _merge(starts, ends) if len(mine) > 1 else (starts, ends)
            if starts.size == 0:
                continue
            sel = region == r
            o, n = offset[sel], length[sel]
            idx = np.searchsorted(starts, o, side="right") - 1
            j = np.maximum(idx, 0)
            ok[sel] = (idx >= 0) & (n <= ends[j] - o)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            return Verdict(False, known, f"descriptor {i} (region {int(region[i])}, bytes [{int(offset[i])}, "
                                         f"{int(offset[i]) + int(length[i])})) lies outside the '{mode}' grant of key "
                                         f"{key!r}")
        return Verdict(True, known)

    def allows_notify(self, key: str | None, peer: str, op: str) -> bool:
        """A notification (or failure report) for `key` from `peer` about an `op`: delivered only if a live grant
        of the key admits the peer ('write'/'read' need a grant of that mode; 'notify' any)."""
        if key is None:
            return False
        now = self.clock()
        mode = _OP_MODE.get(op)
        with self._lock:
            return any(g.admits(peer, now) and (mode is None or g.mode == mode) for g in self._by_key.get(key, ()))

    def begin(self, key: str) -> None:
        with self._lock:
            self._active[key] = self._active.get(key, 0) + 1

    def end(self, key: str) -> None:
        with self._lock:
            n = self._active.get(key, 0) - 1
            if n > 0:
                self._active[key] = n
            else:
                self._active.pop(key, None)

"""Stop strings on a text stream: emit only text that cannot turn out to be part of a stop string.

Why hold text back: a stop string can arrive split over several deltas ("<|e", "nd|>"); text emitted before the
split is noticed cannot be taken back from a client's stream. So the tail of the stream that is a prefix of some
stop string waits until the next delta settles it: either it completes a stop string (the output is cut there) or
it no longer can (it is released).
"""

from __future__ import annotations


class StopChecker:
    """Feed text deltas in order; get back what is safe to emit and the stop string matched, if any."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop = list(dict.fromkeys(stop))  # de-duplicated, order kept
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self._held = ""

    @property
    def held(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return (text to emit now, the stop string that matched or None).

        After a match the request is over: later deltas (tokens already in flight) are dropped, returning
        ("", the matched string) again, so a caller that sees one more output does not leak text past the stop.
        """
        if self.matched is not None:
            return "", self.matched
        if not self.stop:
            return delta, None
        buf = self._held + delta
        # `held` never contains a whole stop string, so a match must end in `delta`: search from where it could start.
        match_at, match = self._earliest_match(buf, max(0, len(self._held) - self._max_len + 1))
        if match is not None:
            self.matched = match
            self._held = ""
            end = match_at + len(match) if self.include_stop_str_in_output else match_at
            return buf[:end], match
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """Release held text when the request ends for another reason (EOS, length, abort)."""
        out, self._held = self._held, ""
        return out

    @property
    def _max_len(self) -> int:
        return max(len(s) for s in self.stop)

    def _earliest_match(self, buf: str, start: int) -> tuple[int, str | None]:
        """The stop string that is complete first in `buf` (the longest where several end at the same place).

        "First complete", not "first to start": a stream cannot wait to see whether "ab" grows into "abc", so
        this rule gives the same answer however the text is split into deltas.
        """
        best_end, best_at, best = len(buf) + 1, -1, None
        for s in self.stop:
            at = buf.find(s, start)
            if at == -1:
                continue
            end = at + len(s)
            if end < best_end or (end == best_end and best is not None and len(s) > len(best)):
                best_end, best_at, best = end, at, s
        return best_at, best

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest

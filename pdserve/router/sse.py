"""SSE pass-through with minimal parsing.

The router relays the decode instance's event stream byte for byte, except for the one thing it must change: it
always asks upstream for usage (the final usage chunk carries `pd_timings`), so it pops `pd_timings` and, when the
client did not ask for usage, drops usage from what the client sees. Only events whose bytes mention `"usage"` or
`"pd_timings"` are parsed; every other event is forwarded untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol import error_body

DONE = b"[DONE]"


def pop_timings(obj: dict[str, Any]) -> Any:
    """Remove and return `pd_timings` from a chunk or response body (top level, or inside `usage`)."""
    timings = obj.pop("pd_timings", None)
    usage = obj.get("usage")
    if isinstance(usage, dict) and "pd_timings" in usage:
        inner = usage.pop("pd_timings")
        timings = timings if timings is not None else inner
    return timings


def error_event(message: str, code: int = 502, type_: str = "upstream_error") -> bytes:
    """An OpenAI-shaped error as one SSE event, followed by [DONE] so clients stop reading."""
    payload = json.dumps(error_body(message, type_, None, code))
    return b"data: " + payload.encode() + b"\n\ndata: [DONE]\n\n"


@dataclass
class SSEFilter:
    """Incremental transformer: feed upstream bytes, get the bytes to send to the client."""

    client_wants_usage: bool
    timings: list[Any] = field(default_factory=list)
    saw_done: bool = False
    saw_error: bool = False
    saw_content: bool = False  # a data event other than usage/[DONE] went out (for TTFT)
    _buf: bytes = b""

    def feed(self, chunk: bytes) -> bytes:
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        self._buf += chunk
        if b"\n\n" not in self._buf:
            return b""
        *events, self._buf = self._buf.split(b"\n\n")
        return b"".join(self._event(e) for e in events)

    def flush(self) -> bytes:
        """At end of stream: whatever complete-looking event remains."""
        rest, self._buf = self._buf.strip(b"\n"), b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or b"\ndata:" in event:
            return event + b"\n\n"  # comments, other fields, multi-line data: relay as they are
        payload = event[5:].strip()
        if payload == DONE:
            self.saw_done = True
            return event + b"\n\n"
        if b'"pd_timings"' not in payload and b'"error"' not in payload:
            if b'"usage"' not in payload:
                self.saw_content = True
                return event + b"\n\n"
            # fast path for the `"usage": null` every chunk carries once usage is on: bytes, not JSON (an unescaped
            # quote cannot occur inside a JSON string, so these byte patterns are always the field itself)
            nulls = payload.count(b'"usage":null') + payload.count(b'"usage": null')
            if nulls == payload.count(b'"usage"'):
                self.saw_content = True
                if self.client_wants_usage:
                    return event + b"\n\n"
                stripped = payload.replace(b',"usage":null', b"").replace(b', "usage": null', b"")
                if b'"usage"' not in stripped:
                    return b"data: " + stripped + b"\n\n"
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict):
            return event + b"\n\n"
        if "error" in obj and "choices" not in obj:
            self.saw_error = True
            return event + b"\n\n"
        changed = False
        timings = pop_timings(obj)
        if timings is not None:
            self.timings.append(timings)
            changed = True
        if not self.client_wants_usage and "usage" in obj:
            usage = obj.pop("usage")
            changed = True
            if usage is not None and not obj.get("choices"):
                return b""  # the pure usage chunk the client did not ask for
        if obj.get("choices"):
            self.saw_content = True
        if not changed:
            return event + b"\n\n"
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

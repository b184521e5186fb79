"""Validation of control frames at the edge: every field a peer sends is checked for type, size and range before
the agent acts on it. A frame that fails is dropped and logged with the peer's identity; it never raises further.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.kv.regions import KINDS, RemoteRegion
from pdserve.kv.wire import MAX_KEY_BYTES

MAX_REGIONS = 4096
MAX_TEXT = 4096
NOTIF_OPS = ("write", "read", "notify")


class FrameError(ValueError):
    """A frame whose content breaks the protocol (it is dropped, the connection stays)."""


def _int(d: dict[str, Any], k: str, lo: int, hi: int) -> int:
    v = d.get(k)
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        raise FrameError(f"field {k!r} must be an integer in [{lo}, {hi}]")
    return v


def _str(d: dict[str, Any], k: str, limit: int = 256, optional: bool = False) -> str | None:
    v = d.get(k)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise FrameError(f"field {k!r} must be a string of at most {limit} characters")
    return v


def _bytes(d: dict[str, Any], k: str, limit: int) -> bytes:
    v = d.get(k)
    if not isinstance(v, bytes) or len(v) > limit:
        raise FrameError(f"field {k!r} must be bytes, at most {limit}")
    return v


def _dict(v: Any, what: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise FrameError(f"{what} must be a map with string keys")
    return v


def region(d: Any) -> RemoteRegion:
    d = _dict(d, "a region entry")
    kind = _str(d, "kind", 16)
    if kind not in KINDS:
        raise FrameError(f"region kind must be one of {KINDS}")
    export = _dict(d.get("export"), "a region's export")
    for k, v in export.items():
        _dict(v, f"the {k} export of a region")
    unit = d.get("unit", 0)
    if type(unit) is not int or not 0 <= unit < 1 << 62:
        raise FrameError("field 'unit' must be a non-negative integer")
    return RemoteRegion(_int(d, "id", 0, (1 << 32) - 1), str(_str(d, "name")), str(kind), _int(d, "device", -1, 1 << 16),
                        _int(d, "size", 0, (1 << 62) - 1), str(_str(d, "uuid", 128, optional=True) or ""), export, unit)


def regions(v: Any) -> dict[int, RemoteRegion]:
    if not isinstance(v, list) or len(v) > MAX_REGIONS:
        raise FrameError(f"regions must be a list of at most {MAX_REGIONS} entries")
    out = {}
    for d in v:
        r = region(d)
        out[r.region_id] = r
    return out


@dataclass(frozen=True)
class Hello:
    """What an authenticated peer tells about itself (its name comes from the handshake, not from here)."""

    address: str
    host_id: str
    pid: int
    transports: list[str]
    regions: dict[int, RemoteRegion]
    extra: dict[str, Any]


def hello(msg: dict[str, Any], kind: str) -> Hello:
    if msg.get("t") != kind:
        raise FrameError(f"expected {kind}, got {str(msg.get('t'))[:32]!r}")
    transports = msg.get("transports")
    if not isinstance(transports, list) or len(transports) > 16 or not all(isinstance(t, str) and len(t) < 32
                                                                          for t in transports):
        raise FrameError("field 'transports' must be a short list of names")
    return Hello(str(_str(msg, "address", 300)), str(_str(msg, "host_id", 300)), _int(msg, "pid", 0, 1 << 31),
                 list(transports), regions(msg.get("regions")), _dict(msg.get("extra"), "field 'extra'"))


@dataclass(frozen=True)
class Note:
    xfer_id: int
    op: str
    payload: bytes
    key: str | None
    error: str | None


def note(msg: dict[str, Any], max_payload: int) -> Note:
    """A 'notif' or 'failed' frame."""
    op = msg.get("op")
    if op not in NOTIF_OPS:
        raise FrameError(f"notification op must be one of {NOTIF_OPS}")
    key = _str(msg, "k", MAX_KEY_BYTES, optional=True)
    why = None
    if msg.get("t") == "failed":
        why = str(_str(msg, "why", MAX_TEXT, optional=True) or "unknown")
    return Note(_int(msg, "x", 0, (1 << 63) - 1), str(op), _bytes(msg, "p", max_payload), key or None, why)


def transport_message(msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A 'tp' frame: (transport name, its message map with a string 'op')."""
    name = str(_str(msg, "tr", 32))
    body = _dict(msg.get("m"), "field 'm'")
    _str(body, "op", 32)
    return name, body


def region_update(msg: dict[str, Any]) -> tuple[dict[int, RemoteRegion], dict[str, Any]]:
    return regions(msg.get("regions")), _dict(msg.get("extra"), "field 'extra'")

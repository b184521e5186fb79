"""NVTX ranges around transfers (AgentConfig.nvtx), so Nsight Systems timelines show each transfer on both sides.

Process-wide start/end ranges (not push/pop): a transfer's range opens and closes on the event loop around awaits,
where other transfers interleave. With CUDA unavailable (or nvtx off) every call is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_backend: Any = None
_resolved = False


def backend() -> Any:
    """torch.cuda.nvtx when CUDA is usable, else None (looked up once)."""
    global _backend, _resolved
    if not _resolved:
        _resolved = True
        try:
            import torch

            if torch.cuda.is_available():
                _backend = torch.cuda.nvtx
        except Exception:  # no torch, or a broken CUDA set-up: ranges are simply off
            _backend = None
    return _backend


@contextmanager
def nvtx_range(enabled: bool, message: str) -> Iterator[None]:
    b = backend() if enabled else None
    if b is None:
        yield
        return
    rid = b.range_start(message)
    try:
        yield
    finally:
        b.range_end(rid)


def mark(enabled: bool, message: str) -> None:
    b = backend() if enabled else None
    if b is not None:
        b.mark(message)

"""Attention backends by name, imported only when chosen (a missing or broken Triton never breaks start-up)."""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

_BACKENDS: dict[str, str] = {
    "torch": "pdserve.ops.attention.torch_ref:TorchAttentionBackend",
    "triton": "pdserve.ops.attention.triton_backend:TritonAttentionBackend",
}


def register_backend(name: str, target: str) -> None:
    """Add a backend as a "module:Class" string; the module is imported when the backend is chosen."""
    if ":" not in target:
        raise ValueError(f"backend target {target!r} is not 'module:Class'")
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def load_backend_class(name: str) -> type:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {available_backends()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, device: torch.device | str):
    """An instance of the named backend; `auto` is triton on CUDA when it imports, else torch."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            try:
                return load_backend_class("triton")()
            except Exception as e:  # no (working) Triton: the reference still works
                log.warning("triton attention unavailable (%s: %s); using the torch reference", type(e).__name__, e)
        name = "torch"
    return load_backend_class(name)()

"""Registered memory regions: the only memory a peer may read or write.

Why a table of regions instead of raw pointers on the wire: every incoming descriptor is checked against the sizes
in this table before a byte moves, so a bad descriptor is an error message and never an out-of-bounds write, and
ids (not addresses) are all a peer learns. Regions are registered once (the KV pool is one tensor) and live until
deregistered; a failed transfer never invalidates them.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.kv.errors import RegionError

KINDS = ("cpu", "pinned", "cuda")


def host_id() -> str:
    """Identity of this machine: two agents with the same host id may use same-host transports (cuda_ipc)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


@dataclass
class MemoryRegion:
    """One registered, contiguous run of bytes in this process."""

    region_id: int
    name: str
    kind: str  # cpu | pinned | cuda
    device: int  # CUDA ordinal, -1 for host memory
    ptr: int
    size: int
    obj: Any  # keeps the memory alive
    host_view: memoryview | None = None  # writable bytes view for host memory
    tensor: Any = None  # flat torch.uint8 view (CUDA regions, and host tensors)
    device_uuid: str = ""
    export: dict[str, Any] = field(default_factory=dict)  # per-transport sharing info (e.g. CUDA IPC handle)
    unit: int = 0  # transfer granularity in bytes (NIXL prepares one descriptor per unit); 0: none declared

    def describe(self) -> dict[str, Any]:
        """What authenticated peers learn about this region after the handshake."""
        return {"id": self.region_id, "name": self.name, "kind": self.kind, "device": self.device, "size": self.size,
                "uuid": self.device_uuid, "export": self.export, "unit": self.unit}


@dataclass
class RemoteRegion:
    region_id: int
    name: str
    kind: str
    device: int
    size: int
    device_uuid: str
    export: dict[str, Any]
    unit: int = 0


def _torch():
    import torch

    return torch


def make_region(region_id: int, obj: Any, name: str) -> MemoryRegion:
    """Wrap a torch tensor, numpy array, bytearray or writable memoryview as a region (no copy)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        torch = _torch()
        if not isinstance(obj, torch.Tensor):
            raise RegionError(f"cannot register a {type(obj).__name__}")
        if not obj.is_contiguous():
            raise RegionError("a registered tensor must be contiguous (the KV pool is one contiguous tensor)")
        flat = obj.reshape(-1).view(torch.uint8)
        size = flat.numel()
        if obj.is_cuda:
            dev = obj.device.index if obj.device.index is not None else torch.cuda.current_device()
            uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", ""))
            return MemoryRegion(region_id, name, "cuda", dev, obj.data_ptr(), size, obj, None, flat, uuid)
        if obj.device.type != "cpu":
            raise RegionError(f"cannot register memory on device {obj.device}")
        kind = "pinned" if obj.is_pinned() else "cpu"
        view = memoryview(flat.numpy()).cast("B") if size else memoryview(bytearray())
        return MemoryRegion(region_id, name, kind, -1, obj.data_ptr(), size, obj, view, flat)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous or not obj.flags.writeable:
            raise RegionError("a registered numpy array must be C-contiguous and writeable")
        view = memoryview(obj.reshape(-1).view(np.uint8))
        return MemoryRegion(region_id, name, "cpu", -1, int(obj.ctypes.data), obj.nbytes, obj, view)
    if isinstance(obj, (bytearray, memoryview)):
        view = memoryview(obj).cast("B")
        if view.readonly:
            raise RegionError("a registered buffer must be writeable")
        arr = np.frombuffer(view, dtype=np.uint8)
        return MemoryRegion(region_id, name, "cpu", -1, int(arr.ctypes.data) if arr.size else 0, view.nbytes, obj, view)
    raise RegionError(f"cannot register a {type(obj).__name__}: use a torch tensor, numpy array or bytearray")


class RegionTable:
    """Thread-safe id -> region map (tcp receive threads read it while the event loop registers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._regions: dict[int, MemoryRegion] = {}
        self._sizes: dict[int, int] = {}

    def add(self, obj: Any, name: str | None, unit: int = 0) -> MemoryRegion:
        with self._lock:
            rid = self._next
            self._next += 1
            nm = name or f"region{rid}"
            if any(r.name == nm for r in self._regions.values()):
                raise RegionError(f"a region named {nm!r} is already registered")
            reg = make_region(rid, obj, nm)
            if unit < 0 or unit > max(reg.size, 1) or (unit and reg.size % unit):
                raise RegionError(f"unit_bytes={unit} must divide the region's {reg.size} bytes")
            reg.unit = unit
            regions = dict(self._regions)
            regions[rid] = reg
            self._regions = regions  # copy-on-write: readers never see a half-updated dict
            self._sizes = {k: v.size for k, v in regions.items()}
            return reg

    def remove(self, rid: int) -> MemoryRegion:
        with self._lock:
            if rid not in self._regions:
                raise RegionError(f"region {rid} is not registered (deregistered twice?)")
            regions = dict(self._regions)
            reg = regions.pop(rid)
            self._regions = regions
            self._sizes = {k: v.size for k, v in regions.items()}
            return reg

    def get(self, rid: int) -> MemoryRegion:
        try:
            return self._regions[rid]
        except KeyError:
            raise RegionError(f"region {rid} is not registered") from None

    def by_name(self, name: str) -> MemoryRegion:
        for r in self._regions.values():
            if r.name == name:
                return r
        raise RegionError(f"no region named {name!r}")

    def sizes(self) -> dict[int, int]:
        return self._sizes

    def all(self) -> list[MemoryRegion]:
        return list(self._regions.values())


def pid_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"

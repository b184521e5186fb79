"""The peak of the bytes that tensors made inside a block hold at once, measured on any device (CPU included): a
dispatch mode that counts each new storage an op returns until the last tensor on it is collected. Tests use it to
bound a function's temporaries where torch.cuda's memory statistics are not available."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, int] = {}  # storage address -> live tensors seen on it
        self._size: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _drop(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.now -= self._size.pop(key)
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            if key not in self._refs:
                self._refs[key] = 0
                self._size[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self._refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out

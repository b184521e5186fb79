"""The rendezvous store of one pair's communicator (the nccl transport), carried on the pair's authenticated control
connection instead of a port of its own.

Why not a TCPStore: it listens and answers anyone who connects (it has no authentication), and what a rendezvous
puts into it (NCCL's unique id with its bootstrap address and magic, Gloo's listening addresses) is what a stranger
needs to join or impersonate a member of the communicator. Here nothing new listens: rank 0 keeps the map in memory
(`LocalMap`), rank 1 reaches it by messages on the control connection of the pair (MACed, ordered, and only between
two agents that proved the deployment secret). torch's process groups take any `torch.distributed.Store`, Python
subclasses included; `make_store` builds one over either side's `call`.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

MAX_KEYS = 4096
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1 << 20
FUNCTIONS = ("set", "get", "add", "compare_set", "check", "wait", "delete", "num_keys", "append", "multi_get",
             "multi_set")

Call = Callable[[str, list, float], Any]  # (function, arguments, timeout seconds) -> result; raises on failure


class StoreError(RuntimeError):
    """A store call that was malformed, over a bound, or failed on rank 0."""


def _key(k: Any) -> str:
    if not isinstance(k, str) or not k or len(k) > MAX_KEY_CHARS:
        raise StoreError(f"a store key must be a non-empty string of at most {MAX_KEY_CHARS} characters")
    return k


def _value(v: Any) -> bytes:
    if isinstance(v, str):
        v = v.encode()
    if not isinstance(v, (bytes, bytearray, memoryview)) or len(v) > MAX_VALUE_BYTES:
        raise StoreError(f"a store value must be bytes, at most {MAX_VALUE_BYTES}")
    return bytes(v)


def _keys(ks: Any) -> list[str]:
    if not isinstance(ks, list) or len(ks) > 64:
        raise StoreError("store keys must be a list of at most 64 keys")
    return [_key(k) for k in ks]


class LocalMap:
    """Rank 0's key-value map: thread-safe, blocking reads bounded by a timeout, bounded in size."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def _put(self, k: str, v: bytes) -> None:
        if k not in self._d and len(self._d) >= MAX_KEYS:
            raise StoreError(f"the pair's store holds {MAX_KEYS} keys already")
        self._d[k] = v
        self._cv.notify_all()

    def _wait_for(self, keys: list[str], timeout: float) -> None:
        end = time.monotonic() + timeout
        while not all(k in self._d for k in keys):
            left = end - time.monotonic()
            if left <= 0:
                raise StoreError(f"store keys {keys} did not appear within {timeout:g} s")
            self._cv.wait(left)

    def call(self, fn: str, args: list, timeout: float) -> Any:
        """One store operation by name, with arguments as they travel (validated here: rank 1 sends them)."""
        if fn not in FUNCTIONS or not isinstance(args, list):
            raise StoreError(f"unknown store function {str(fn)[:32]!r}")
        with self._cv:
            if fn == "set":
                self._put(_key(args[0]), _value(args[1]))
                return None
            if fn == "get":
                k = _key(args[0])
                self._wait_for([k], timeout)
                return self._d[k]
            if fn == "add":
                k, n = _key(args[0]), args[1]
                if type(n) is not int:
                    raise StoreError("store add needs an integer")
                v = int(self._d.get(k, b"0")) + n
                self._put(k, str(v).encode())
                return v
            if fn == "compare_set":
                k, expected, desired = _key(args[0]), _value(args[1]), _value(args[2])
                cur = self._d.get(k)
                if (cur is None and not expected) or cur == expected:
                    self._put(k, desired)
                    return desired
                return cur if cur is not None else expected
            if fn == "check":
                return all(k in self._d for k in _keys(args[0]))
            if fn == "wait":
                self._wait_for(_keys(args[0]), min(timeout, float(args[1])) if args[1:] else timeout)
                return None
            if fn == "delete":
                return self._d.pop(_key(args[0]), None) is not None
            if fn == "append":
                k, v = _key(args[0]), _value(args[1])
                self._put(k, _value(self._d.get(k, b"") + v))
                return None
            if fn == "multi_get":
                keys = _keys(args[0])
                self._wait_for(keys, timeout)
                return [self._d[k] for k in keys]
            if fn == "multi_set":
                keys, values = _keys(args[0]), args[1]
                if not isinstance(values, list) or len(values) != len(keys):
                    raise StoreError("store multi_set needs one value per key")
                for k, v in zip(keys, [_value(v) for v in values]):
                    self._put(k, v)
                return None
            return len(self._d)


def _seconds(t: Any, default: float) -> float:
    if isinstance(t, datetime.timedelta):
        return max(0.001, min(default, t.total_seconds()))
    return default


def make_store(call: Call, timeout: float) -> Any:
    """A torch.distributed.Store whose every operation is `call(function, arguments, timeout)`."""
    import torch.distributed as dist

    class PairStore(dist.Store):
        def set(self, key: str, value: Any) -> None:
            call("set", [key, _value(value)], timeout)

        def get(self, key: str) -> bytes:
            return call("get", [key], timeout)

        def add(self, key: str, amount: int) -> int:
            return call("add", [key, int(amount)], timeout)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return call("compare_set", [key, _value(expected), _value(desired)], timeout)

        def check(self, keys: list[str]) -> bool:
            return call("check", [list(keys)], timeout)

        def wait(self, keys: list[str], wait_timeout: Any = None) -> None:
            t = _seconds(wait_timeout, timeout)
            call("wait", [list(keys), t], t)

        def delete_key(self, key: str) -> bool:
            return call("delete", [key], timeout)

        def num_keys(self) -> int:
            return call("num_keys", [], timeout)

        # the "extended" API: a Python store must define these itself (torch's binding asserts "Not implemented."
        # instead of falling back), and torch 2.11's NCCL process group calls them while it sets up
        def append(self, key: str, value: Any) -> None:
            call("append", [key, _value(value)], timeout)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return call("multi_get", [list(keys)], timeout)

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            call("multi_set", [list(keys), [_value(v) for v in values]], timeout)

        def has_extended_api(self) -> bool:
            return True

    return PairStore()

"""Kernels Triton compiles while the engine serves, after the start-up warm-up should have compiled them all.

Why: a compile takes from a few hundred milliseconds to seconds, and it happens inside a step, so every request in
that step waits. On an H200 (dummy Qwen3-8B, 256 prompts of 1024 tokens sent at once to a fresh server) the first
wave's first tokens came in runs with pauses of 1.2-1.4 s between them and the wave took 12.6 s, while the same
burst through the engine after bench_steps had run every step shape took 6.5 s and a second burst on the same
server no pauses (benchmarks/lease_s7). Which kernels were compiled there was not recorded; this records it.

One watcher per process (Triton's hooks are process-wide): `install()` chains onto `triton.knobs.runtime`'s
jit_cache_hook (called when a kernel's specialization is not in the process's cache: a compile, or a load from
Triton's disk cache) and jit_post_compile_hook; `arm()` after the warm-up; from then on each new specialization is
counted and logged with its time to compile, and with what set it apart from the nearest specialization of the same
kernel compiled before (an argument's type, value class or alignment, a constexpr, the warps/stages): which argument
of which call site the warm-up missed. Triton's own `repr` of a specialization is not used: in 3.6 it zips the
parameter names with the characters of the key string.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

MAX_LOGGED = 50  # specializations logged one by one; the count goes on
MAX_SEEN = 64  # specializations remembered per kernel for the comparison


def describe(compile: dict) -> dict[str, str]:
    """One specialization as {parameter: type, constexpr value and attributes}, plus "options" (warps, stages),
    from the `compile` argument of Triton's hooks (signature, constants by path, attributes by path)."""
    sig = dict(compile.get("signature") or {})
    names = list(sig)
    out = {name: str(t) for name, t in sig.items()}
    for path, value in (compile.get("constants") or {}).items():
        if path and path[0] < len(names):
            out[names[path[0]]] = f"={value!r}"
    configs = compile.get("configs") or [{}]
    for path, attrs in (configs[0] or {}).items():
        if path and path[0] < len(names):
            out[names[path[0]]] += "/" + ",".join(f"{a[0]}={a[1]}" for a in attrs)
    out["options"] = f"warps={compile.get('num_warps')},stages={compile.get('num_stages')}"
    return out


def difference(new: dict[str, str], seen: list[dict[str, str]]) -> str:
    """What sets `new` apart from the closest of `seen` ("first of its kernel" when none)."""
    if not seen:
        return "first of its kernel"
    def diffs(old):
        return [k for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)]
    old = min(seen, key=lambda o: len(diffs(o)))
    return "; ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in diffs(old)) or "same as one compiled before"


class JitWatch:
    def __init__(self) -> None:
        self.armed = False
        self.compiled_after_arm = 0
        self.seconds_after_arm = 0.0
        self._started: dict[object, tuple[float, str]] = {}
        self._seen: dict[str, list[dict[str, str]]] = {}  # kernel name -> specializations missed so far
        self._lock = threading.Lock()
        self._prev_cache = self._prev_post = None
        self.installed = False

    def install(self) -> bool:
        """Chain onto Triton's hooks (once); False when Triton is missing."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = knobs.runtime
        self._prev_cache, self._prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
        rt.jit_cache_hook, rt.jit_post_compile_hook = self.on_miss, self.on_compiled
        self.installed = True
        return True

    def arm(self) -> None:
        with self._lock:
            self.armed = True
            self.compiled_after_arm = 0
            self.seconds_after_arm = 0.0

    def on_miss(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        name = getattr(fn, "name", None) or str(repr).split("[", 1)[0]
        try:
            desc = describe(compile or {})
        except Exception:  # a Triton whose hook arguments look otherwise: count the compile, skip the comparison
            desc = {}
        with self._lock:
            seen = self._seen.setdefault(name, [])
            if self.armed:
                self._started[key] = (time.monotonic(), f"{name} ({difference(desc, seen) if desc else 'unknown'})")
            if desc and len(seen) < MAX_SEEN:
                seen.append(desc)
        if self._prev_cache is not None:  # a truthy answer tells Triton to skip the compile: pass it on as is
            return self._prev_cache(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                    already_compiled=already_compiled)
        return None

    def on_compiled(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        with self._lock:
            started = self._started.pop(key, None)
            if started is not None:
                t0, what = started
                dt = time.monotonic() - t0
                self.compiled_after_arm += 1
                self.seconds_after_arm += dt
                n = self.compiled_after_arm
        if started is not None and n <= MAX_LOGGED:
            log.warning("compiled a kernel while serving (%.2f s; the warm-up did not cover it): %s", dt, what)
        if self._prev_post is not None:
            return self._prev_post(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                   already_compiled=already_compiled)
        return None

    def stats(self) -> dict:
        return {"kernels_compiled_after_warmup": self.compiled_after_arm,
                "kernel_compile_s_after_warmup": round(self.seconds_after_arm, 3)}


WATCH = JitWatch()  # this process's

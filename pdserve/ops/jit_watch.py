"""Kernels Triton compiles while the engine serves, after the start-up warm-up should have compiled them all.

Why: a compile takes from a few hundred milliseconds to seconds, and it happens inside a step, so every request in
that step waits. On an H200 (dummy Qwen3-8B, 256 prompts of 1024 tokens sent at once to a fresh server) the first
wave's first tokens came in runs with pauses of 1.2-1.4 s between them and the wave took 12.6 s, while the same
burst through the engine after bench_steps had run every step shape took 6.5 s and a second burst on the same
server no pauses (benchmarks/lease_s7). Which kernels were compiled there was not recorded; this records it.

One watcher per process (Triton's hooks are process-wide): `install()` chains onto `triton.knobs.runtime`'s
jit_cache_hook (called when a kernel's specialization is not in the process's cache: a compile, or a load from
Triton's disk cache) and jit_post_compile_hook; `arm()` after the warm-up; from then on each new specialization is
counted and logged with its time to compile.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

MAX_LOGGED = 50  # specializations logged one by one; the count goes on


class JitWatch:
    def __init__(self) -> None:
        self.armed = False
        self.compiled_after_arm = 0
        self.seconds_after_arm = 0.0
        self._started: dict[object, float] = {}
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
        if self.armed:
            with self._lock:
                self._started[key] = time.monotonic()
        if self._prev_cache is not None:  # a truthy answer tells Triton to skip the compile: pass it on as is
            return self._prev_cache(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                    already_compiled=already_compiled)
        return None

    def on_compiled(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        with self._lock:
            t0 = self._started.pop(key, None)
            if t0 is not None:
                dt = time.monotonic() - t0
                self.compiled_after_arm += 1
                self.seconds_after_arm += dt
                n = self.compiled_after_arm
        if t0 is not None and n <= MAX_LOGGED:
            log.warning("compiled a kernel while serving (%.2f s; the warm-up did not cover it): %s", dt, repr)
        if self._prev_post is not None:
            return self._prev_post(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                   already_compiled=already_compiled)
        return None

    def stats(self) -> dict:
        return {"kernels_compiled_after_warmup": self.compiled_after_arm,
                "kernel_compile_s_after_warmup": round(self.seconds_after_arm, 3)}


WATCH = JitWatch()  # this process's

"""Python's garbage collector pauses in every process of a run, for a lent machine where one call must show them.

    PYTHONPATH=benchmarks/debug/gc_probe GC_PROBE_DIR=$OUT/gc pdserve serve ...

Each Python process started with this folder on PYTHONPATH (the server, its engine and worker processes, the
router, the clients) times every collection by generation and appends a summary line to $GC_PROBE_DIR/<pid>.log
at most every 5 s and at exit: how many collections of each generation, their total and longest pause, and whether
the heap was frozen (gc.freeze). Each full (generation 2) collection and each pause over 10 ms also gets a line of
its own with its wall-clock time (`pause <epoch> gen<g> <ms> frozen=<n>`), so a run's window can be cut out exactly
(session 26's summary lines alone bracket a run only to within a dump's 5 s). A full collection scans every tracked
object; a process that holds torch, the model's modules and compiled kernels' caches has hundreds of thousands (a
CPU engine process here: 180k, 80 ms a full collection), and a pause in the engine or the server's process delays every stream it serves. vLLM freezes
its start-up heap (gc.freeze) in its engine core, its API server and its bench client; pdserve does too since
session 26 (pdserve.gc_heap; PDSERVE_GC_FREEZE=0 turns it off).
"""

import atexit
import gc
import os
import sys
import time

_DIR = os.environ.get("GC_PROBE_DIR", "/tmp/gc_probe")
_pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
_state = {"start": 0.0, "last": time.monotonic()}


def _append(line: str) -> None:
    try:
        os.makedirs(_DIR, exist_ok=True)
        with open(os.path.join(_DIR, f"{os.getpid()}.log"), "a") as f:
            f.write(line + "\n")
    except Exception:  # a probe must never break the process it watches
        pass


def _dump() -> None:
    parts = [f"gen{g}: n={len(v)} total={sum(v) * 1e3:.1f}ms max={max(v) * 1e3:.1f}ms" for g, v in _pauses.items() if v]
    _append(f"{time.time():.1f} {' '.join(sys.argv[:3])[:100]} frozen={gc.get_freeze_count()} | {' | '.join(parts)}")


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _state["start"] = time.perf_counter()
        return
    pause = time.perf_counter() - _state["start"]
    _pauses[info["generation"]].append(pause)
    if info["generation"] == 2 or pause > 0.01:  # each full collection and each long pause on a line of its own
        _append(f"pause {time.time():.3f} gen{info['generation']} {pause * 1e3:.1f}ms frozen={gc.get_freeze_count()}")
    now = time.monotonic()
    if now - _state["last"] > 5:
        _state["last"] = now
        _dump()


gc.callbacks.append(_callback)
atexit.register(_dump)

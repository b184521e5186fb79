"""A serving process's start-up heap, frozen once the process is ready, so that Python's collector never scans it
again (as vLLM's freeze_gc_heap in its engine core, API server and bench client).

A process that holds torch, the model's modules and compiled kernels' caches tracks hundreds of thousands of
objects (a CPU engine process: ~180k, ~80 ms a full collection). A full collection while serving scans them all,
and the pause stops every stream the process serves. Frozen objects move to a permanent generation that no
collection scans; what is allocated while serving is collected as before. Only processes pdserve starts for itself
freeze (the engine process and its tensor-parallel workers, an instance's server, the router, the launcher): a
library user's process keeps its collector as it was. `PDSERVE_GC_FREEZE=0` turns it off (pdserve.envs).
"""

from __future__ import annotations

import gc
import logging
import time

from pdserve import envs

log = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect once, then freeze what is left; returns the objects frozen in this process in all (0: off)."""
    if not envs.gc_freeze():
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("%s: %d objects frozen out of the garbage collector's scans (%.0f ms)", who, n,
             (time.perf_counter() - t0) * 1e3)
    return n

"""Messages to the engine process, sent from a thread of their own so the server's event loop never waits on the pipe.

Why: the engine process reads its pipe between steps, and a prefill step takes a few hundred milliseconds. A pipe
holds 64 KiB, about a dozen requests of a thousand tokens, so when a client sends hundreds of requests at once a
send from the event loop blocks until the engine's next read. While it blocks, nothing else on the loop runs: no
first token reaches its client, no stream is written, /health and /load do not answer. Seen on an H200 (dummy
Qwen3-8B, 256 prompts of 1024 tokens sent at once, benchmarks/lease_s7/serve_tl): /load went unanswered for 3.2 s
while the burst arrived. Whether the first wave's TTFT gains was not shown: the next side-by-side run, on another
machine of the same kind, had a higher p90 TTFT than the one before it (benchmarks/lease_s7/sbs2 vs sbs), and the
pauses in that wave look like kernel compiles (pdserve/ops/jit_watch.py), not the pipe.

Messages keep their order (one thread, one FIFO). They are pickled by the caller, as `Connection.send` would (a
message that cannot be pickled raises there, to the request that made it); the thread only writes the bytes. A
failed write (the engine process is gone) is reported once through `on_error`, and what is queued after it is
dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

log = logging.getLogger(__name__)

_CLOSE = object()


class PipeWriter:
    def __init__(self, conn: Connection, on_error: Callable[[BaseException], None],
                 name: str = "pdserve-engine-writer"):
        self.conn = conn
        self.on_error = on_error  # called from the writer thread
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, msg: object) -> None:
        """Pickle `msg` and queue it for the engine; returns without waiting for the pipe."""
        self._queue.put(bytes(ForkingPickler.dumps(msg)))

    def close(self, timeout_s: float = 5.0) -> bool:
        """Send what is queued, then end the thread; False if it did not end within `timeout_s` (the engine is not
        reading: the thread is a daemon and ends with the process)."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return self._failed

    def _run(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is _CLOSE:
                return
            if self._failed:
                continue  # the engine is gone: what was queued after the failure is dropped
            try:
                self.conn.send_bytes(msg)
            except Exception as e:  # broken pipe, closed connection; anything else must not end the thread silently
                self._failed = True
                try:
                    self.on_error(e)
                except Exception:
                    log.exception("the pipe writer's error callback failed")

"""Helper processes that end as soon as the process that started them ends, also when it was killed with SIGKILL.

Tensor-parallel ranks and the server's tokenizer workers run this: without it a SIGKILLed instance (the OOM killer,
`kill -9`) left them running for good (a tokenizer worker blocks reading its task queue, whose write end it holds
itself), each with its memory and, for a rank, its GPU. Light on purpose (no torch): tokenizer workers import it.
"""

from __future__ import annotations

import os
import select
import threading
import time


def exit_with_parent(parent_pid: int, code: int = 3) -> None:
    """End this process with `code` as soon as `parent_pid` ends (at once if it already has): a daemon thread waits
    on the parent's pidfd (polling getppid where pidfds are missing), even while the main thread is blocked."""
    if os.getppid() != parent_pid:
        os._exit(code)

    def watch() -> None:
        try:
            fd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
        os._exit(code)

    threading.Thread(target=watch, name="pdserve-parent-watch", daemon=True).start()

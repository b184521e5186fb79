"""Run a command; if it is still running after a deadline, print every Python stack of its whole process tree
(faulthandler, on SIGABRT) and end it. For a hang on a lent machine, where there is one call to see it.

    python benchmarks/debug/run_with_stacks.py SECONDS -- CMD [ARGS...]

The command runs with PYTHONFAULTHANDLER=1 (its Python children inherit it), its output passes through; at the
deadline each descendant gets SIGABRT, deepest first, then the command itself, and the exit status is 124.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def descendants(pid: int) -> list[int]:
    """Every process under pid, children before their parents (deepest first)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out: list[int] = []

    def walk(p: int) -> None:
        for c in kids.get(p, []):
            walk(c)
            out.append(c)

    walk(pid)
    return out


def main() -> int:
    limit = float(sys.argv[1])
    cmd = sys.argv[sys.argv.index("--") + 1:]
    p = subprocess.Popen(cmd, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return p.returncode
        time.sleep(0.5)
    print(f"run_with_stacks: still running after {limit:.0f} s; the stacks of pid {p.pid} and its descendants:",
          file=sys.stderr, flush=True)
    for pid in descendants(p.pid) + [p.pid]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            print(f"--- pid {pid}: {line}", file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGABRT)
            time.sleep(1.0)
        except OSError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
    return 124


if __name__ == "__main__":
    sys.exit(main())

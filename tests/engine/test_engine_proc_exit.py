"""The engine process always ends: `end_process` runs the cleanup and exits even when a thread is left running,
and a cleanup that hangs (an NCCL teardown on a GPU) is given up after its timeout; a server process killed with
SIGKILL takes its engine process with it (the engine holds the GPU)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest

from pdserve.engine.engine_proc import end_process


def _linger() -> None:
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()  # would keep an ordinary exit waiting


def _ends_after_cleanup(marker: str) -> None:
    _linger()
    end_process(lambda: Path(marker).write_text("closed"), timeout_s=30.0, code=0)


def _cleanup_hangs() -> None:
    _linger()
    end_process(lambda: time.sleep(3600), timeout_s=1.0, code=5)


def _run(target, *args) -> tuple[int | None, float]:
    p = mp.get_context("spawn").Process(target=target, args=args)
    t0 = time.monotonic()
    p.start()
    p.join(60)
    took = time.monotonic() - t0
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the process did not end")
    return p.exitcode, took


def test_cleanup_runs_and_a_lingering_thread_does_not_keep_the_process(tmp_path):
    marker = tmp_path / "closed"
    code, _ = _run(_ends_after_cleanup, str(marker))
    assert code == 0 and marker.read_text() == "closed"


def test_a_hanging_cleanup_is_given_up_after_its_timeout():
    code, took = _run(_cleanup_hangs)
    assert code == 5
    assert took < 30


def _server(q) -> None:  # stands for the server process: starts an engine-like child that watches it, then waits
    child = mp.get_context("spawn").Process(target=_engine_like, daemon=False)
    child.start()
    q.put(child.pid)
    time.sleep(3600)


def _engine_like() -> None:
    from pdserve.engine.parent_watch import exit_with_parent

    exit_with_parent(mp.parent_process().pid)  # as run_engine_process: the pid recorded when it was started
    _linger()
    time.sleep(3600)


def test_engine_like_child_ends_with_a_sigkilled_server():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_server, args=(q,))
    server.start()
    child = q.get(timeout=60)
    server.kill()
    server.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        # a zombie (reaped by init soon) counts as ended
        try:
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.2)
    os.kill(child, 9)
    pytest.fail("the child outlived its killed parent")

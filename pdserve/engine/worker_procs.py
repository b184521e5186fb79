"""The worker processes of a tensor-parallel instance as rank 0 sees them: which device each rank gets, the
environment they start with, starting one (`python -m pdserve.engine.worker FD REPORT_FD`: a socket pair and a
report pipe each, a pidfd to see it end) and stopping them all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.engine.worker import Stop, control_frame
from pdserve.parallel.group import NCCL_ENV


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r uses the instance's device index + r (CUDA); every rank uses the CPU otherwise."""
    if device.type != "cuda":
        return [device] * size
    base = device.index or 0
    need = base + size
    if torch.cuda.device_count() < need:
        raise ValueError(f"tensor parallel size {size} from cuda:{base} needs {need} visible GPUs; "
                         f"{torch.cuda.device_count()} are visible")
    return [torch.device("cuda", base + r) for r in range(size)]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class WorkerProcess:
    """One worker process: its Popen, pipe, report pipe (worker -> rank 0 only) and exit sentinel."""

    def __init__(self, rank: int, env: dict):
        parent, child = Pipe(duplex=True)
        reports, report_w = Pipe(duplex=False)
        self.rank = rank
        self.popen = subprocess.Popen([sys.executable, "-m", "pdserve.engine.worker", str(child.fileno()),
                                       str(report_w.fileno())],
                                      pass_fds=(child.fileno(), report_w.fileno()), env=env)
        child.close()
        report_w.close()
        self.conn: Connection = parent
        self.reports: Connection | None = reports
        self.sentinel = _pidfd(self.popen.pid)

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def waitables(self) -> list:
        return [self.conn] + ([self.sentinel] if self.sentinel is not None else [])

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self) -> None:
        self.conn.close()
        if self.reports is not None:
            self.reports.close()
            self.reports = None
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def stop_workers(procs: list[WorkerProcess], timeout_s: float) -> None:
    """Stop every worker (Stop, then kill after `timeout_s`) and reap it."""
    for p in procs:
        try:
            p.conn.send_bytes(control_frame(Stop()))
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.popen.wait(5)
        p.close()


def worker_env(device: torch.device) -> dict:
    """This process's environment, plus the multi-GPU NCCL settings and the path pdserve imports from."""
    env = dict(os.environ)
    if device.type == "cuda":
        env.update(NCCL_ENV)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env

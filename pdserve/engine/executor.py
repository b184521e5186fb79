"""Rank 0's side of tensor parallelism: starts ranks 1..N-1 as worker processes (pdserve.engine.worker), sends
them every step's plan, runs methods on every rank (`collective_rpc`), and turns the death of any rank into one
clear, fatal error. At size 1 it is a thin shell around rank 0's Worker: no process, no collective.

Start-up: spawn the workers -> each sets its device and says hello -> every rank joins the process group (NCCL on
CUDA, gloo on CPU) -> every rank loads its shard. Steps: rank 0's runner hands each StepPlan to `_send_step` (one
`send_bytes` per worker, microseconds) before running it itself. Failure: a watcher thread waits on every
worker's pidfd; a death marks the executor failed, ends the other workers and wakes the engine loop, whose next
`check()` raises `WorkerDied` (fatal: the engine process fails every request and exits, so /health answers 503).
A step that was blocked in a collective with the dead rank errors out (gloo) or is released by aborting the NCCL
communicator; if it stays blocked past FAIL_GRACE_S the process exits. Every wait on a worker has a timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch

from pdserve.config import EngineConfig
from pdserve.engine.runner import ModelRunner, StepHandle
from pdserve.engine.sampler import SampleResult
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.step_inputs import StepPlan
from pdserve.engine.worker import (
    Call,
    CallResult,
    Worker,
    WorkerFailed,
    WorkerHello,
    WorkerInit,
    WorkerReady,
    control_frame,
    cpu_slice,
    pin_cpus,
    step_frame,
)
from pdserve.engine.worker_procs import WorkerProcess, rank_devices, stop_workers, worker_env
from pdserve.model.loader import ModelSource
from pdserve.parallel.group import SINGLE, destroy_group, init_group, master_store

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # workers started, hello'd and joined the process group
COLLECTIVE_TIMEOUT_S = 600.0  # the process group's limit on any one collective
LOAD_TIMEOUT_S = 1800.0  # every rank's shard loaded
RPC_TIMEOUT_S = 120.0  # default limit of a collective_rpc
CAPTURE_TIMEOUT_S = 1800.0  # CUDA graph capture on every rank
FAIL_GRACE_S = 10.0  # a step blocked with a dead rank gets this long to come back before the process exits
STOP_TIMEOUT_S = 10.0  # a worker asked to stop gets this long before it is killed


class WorkerDied(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the instance cannot go on (fatal)."""

    fatal = True


class Executor:
    """Every rank of one instance, driven from rank 0 (this process). `driver` is rank 0's Worker; after
    `init_runner`, `runner` is its ModelRunner (the engine core's)."""

    def __init__(self, config: EngineConfig, hf_config, source: ModelSource, device: torch.device,
                 dtype: torch.dtype, wake: Callable[[], None] | None = None):
        self.size = config.tensor_parallel_size
        self.device = device
        self.wake = wake or (lambda: None)
        self.failed: str | None = None
        self._procs: list[WorkerProcess] = []
        self._calls = itertools.count(1)
        self._in_step = False
        self._noticed = threading.Event()  # the engine has raised WorkerDied (the failure reached it)
        self._stop_r, self._stop_w = os.pipe() if self.size > 1 else (-1, -1)  # wakes the watcher at close
        self._closed = False
        self._restore_cpu: tuple | None = None
        self._reports: queue.SimpleQueue = queue.SimpleQueue()  # every rank's Worker.report, in arrival order
        self.runner: ModelRunner | None = None
        tp = SINGLE
        if self.size > 1:
            try:
                tp = self._start_workers(config, hf_config, source, dtype)
            except BaseException:
                os.close(self._stop_r)
                os.close(self._stop_w)
                raise
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, tp)
        self.driver = Worker(config, hf_config, source, dtype, device, tp, self._report)
        self.tp = tp
        self._watcher: threading.Thread | None = None
        if self.size > 1:
            self._watcher = threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True)
            self._watcher.start()
        with self.closing_on_error():
            self.collective_rpc("load_model", timeout_s=LOAD_TIMEOUT_S)

    @contextmanager
    def closing_on_error(self) -> Iterator[None]:
        """Close the executor (workers stopped, group left) if the block raises: for the engine's start-up."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    # ---- start-up
    def _start_workers(self, config: EngineConfig, hf_config, source: ModelSource, dtype: torch.dtype):
        devices = rank_devices(self.device, self.size)
        env = worker_env(self.device)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        store = master_store(self.size, START_TIMEOUT_S)
        tp = None
        try:
            for r in range(1, self.size):
                p = WorkerProcess(r, env)
                self._procs.append(p)
                p.conn.send_bytes(control_frame(WorkerInit(
                    r, self.size, config, hf_config, source, dtype, str(devices[r]), store.port, COLLECTIVE_TIMEOUT_S,
                    os.getpid(), cpu_slice(r, self.size, cpus) if cpus and self.device.type != "cuda" else ())))
            deadline = time.monotonic() + START_TIMEOUT_S
            self._await_all(WorkerHello, deadline, "start")
            if self.device.type != "cuda" and cpus:
                self._restore_cpu = (tuple(cpus), torch.get_num_threads())
                pin_cpus(cpu_slice(0, self.size, cpus))
            tp = init_group(0, self.size, self.device, store.port, COLLECTIVE_TIMEOUT_S, store=store,
                            all_reduce=config.tp_all_reduce, dtype=dtype)
            self._await_all(WorkerReady, deadline, "join the process group")
        except BaseException:
            _cleanup(self._procs, tp)
            self._unpin()
            raise
        log.info("tensor parallel: %d ranks on %s", self.size, ", ".join(map(str, devices)))
        return tp

    def _await_all(self, kind: type, deadline: float, what: str) -> None:
        for p in self._procs:
            msg = self._recv(p, deadline, what)
            if isinstance(msg, WorkerFailed):
                raise RuntimeError(f"tensor-parallel rank {p.rank} failed to {what}: {msg.message}\n{msg.traceback}")
            if not isinstance(msg, kind):
                raise RuntimeError(f"tensor-parallel rank {p.rank}: expected {kind.__name__}, got {type(msg).__name__}")

    def _recv(self, p: WorkerProcess, deadline: float, what: str):
        """The next message from worker `p`, watching its exit; raises WorkerDied on death or at the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerDied(self._fail(f"tensor-parallel rank {p.rank} did not {what} in time"))
            ready = wait(p.waitables(), timeout=min(left, 1.0))
            if p.conn in ready:
                try:
                    return p.conn.recv()
                except (EOFError, OSError):
                    pass  # its process ended: reported below
            if p.conn in ready or p.sentinel in ready or p.exit_code() is not None:
                try:
                    code = p.popen.wait(5)
                except subprocess.TimeoutExpired:
                    code = None
                raise WorkerDied(self._fail(f"tensor-parallel rank {p.rank} died while asked to {what} "
                                            f"(exit code {code})"))

    # ---- running things on every rank
    def collective_rpc(self, method: str | Callable, *args, timeout_s: float = RPC_TIMEOUT_S, **kwargs) -> list:
        """Run `method` on every rank's Worker — a Worker method's name, or a function of an importable module
        (pickled by reference) called as fn(worker, *args, **kwargs) — and return the results in rank order.
        Workers start first, then rank 0 runs it here, so methods may use collectives. Raises WorkerDied if a rank
        dies or does not answer within `timeout_s` (fatal), RuntimeError naming the rank if the method raised
        there (the engine goes on)."""
        self.check()
        if callable(method) and getattr(method, "__module__", None) == "__main__" and self._procs:
            raise ValueError(f"collective_rpc: {method.__name__} is defined in __main__, which the worker processes "
                             f"cannot import; define it in a module")
        call_id = next(self._calls)
        frame = control_frame(Call(call_id, method, args, kwargs)) if self._procs else b""
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            self._send(p, frame)
        local: list = []
        local_error: BaseException | None = None
        try:
            local.append(self.driver.call(method, args, kwargs))
        except Exception as e:
            local_error = e
        results = [self._reply(p, call_id, deadline) for p in self._procs]
        if local_error is not None:
            raise local_error
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        for r in results:
            if r.error is not None:
                raise RuntimeError(f"{name} failed on tensor-parallel rank {r.rank}: {r.error}\n{r.traceback}")
        return local + [r.value for r in results]

    def _reply(self, p: WorkerProcess, call_id: int, deadline: float) -> CallResult:
        while True:
            msg = self._recv(p, deadline, "answer a call")
            if isinstance(msg, WorkerFailed):
                raise WorkerDied(self._fail(f"tensor-parallel rank {p.rank} failed: {msg.message}"))
            if isinstance(msg, CallResult) and msg.call_id == call_id:
                return msg
            log.warning("rank %d: dropped a stale %s", p.rank, type(msg).__name__)

    def _send(self, p: WorkerProcess, frame) -> None:
        try:
            p.conn.send_bytes(frame)
        except OSError as e:
            raise WorkerDied(self._fail(f"tensor-parallel rank {p.rank} is gone ({type(e).__name__})")) from e

    def _send_step(self, plan: StepPlan) -> None:
        """Rank 0's runner, before each step: the plan to every other rank."""
        frame = step_frame(plan)
        for p in self._procs:
            self._send(p, frame)

    # ---- reports: what ranks send on their own (Worker.report), e.g. a per-rank KV agent's notifications
    def _report(self, obj: object) -> None:  # any thread of this process, or the watcher for other ranks
        self._reports.put(obj)
        self.wake()

    def has_reports(self) -> bool:
        return not self._reports.empty()

    def take_reports(self) -> list:
        """Every report received since the last call, in arrival order."""
        out = []
        while True:
            try:
                out.append(self._reports.get_nowait())
            except queue.Empty:
                return out

    # ---- what the engine core calls
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) GPU bytes of the tightest rank."""
        infos = self.collective_rpc("mem_get_info")
        return min(f for f, _ in infos), min(t for _, t in infos)

    def pool_memory(self) -> list[tuple[int, int, int, int, int]]:
        """Per rank: (free, total, bytes its tensors hold, bytes in use when the engine opened its GPU, bytes free in
        the blocks PyTorch's allocator keeps)."""
        infos = self.collective_rpc("mem_get_info")
        uses = self.collective_rpc("memory_in_use")
        return [(free, total, tensors, baseline, reserved - tensors)
                for (free, total), (tensors, _, baseline, reserved) in zip(infos, uses)]

    def init_runner(self, num_blocks: int, block_size: int, attention_backend: str,
                    kv_dtype: torch.dtype, probe: bool = False) -> ModelRunner:
        """Every rank's KV pool (its KV heads, `num_blocks` blocks) and runner; rank 0's runner is returned. A
        `probe` pool (KV sizing) is a plain tensor, dropped again by `release_runner`."""
        self.collective_rpc("init_runner", num_blocks, block_size, attention_backend, kv_dtype, probe)
        self.runner = self.driver.runner
        if self.size > 1:
            self.runner.step_sink = self._send_step
        return self.runner

    def release_runner(self) -> None:
        """Every rank drops its runner and pool and returns their memory to the device."""
        self.runner = None
        self.collective_rpc("release_runner")

    def capture_graphs(self, max_batch: int, max_model_len: int, max_tokens: int, emulate: bool = False) -> None:
        self.collective_rpc("capture_graphs", max_batch, max_model_len, max_tokens, emulate,
                            timeout_s=CAPTURE_TIMEOUT_S)

    def execute(self, batch: ScheduledBatch, after_layer=None) -> tuple[list, SampleResult | None]:
        """One step on every rank, waited for; rank 0 samples."""
        handle = self.launch(batch, after_layer)
        return handle.reqs, self.collect(handle)

    def launch(self, batch: ScheduledBatch, after_layer=None) -> StepHandle:
        """Queue one step on every rank (the plan goes to the other ranks first); rank 0 samples on its device."""
        return self._guarded(self.runner.launch, batch, after_layer)

    def collect(self, handle: StepHandle) -> SampleResult | None:
        """Wait for a launched step's sampled ids."""
        return self._guarded(self.runner.collect, handle)

    def _guarded(self, fn, *args):
        self.check()
        self._in_step = True
        try:
            out = fn(*args)
            self.check()  # a rank died during the step (an aborted NCCL collective returns garbage): drop it
            return out
        except WorkerDied:
            raise
        except Exception as e:
            if self.size > 1 and self._worker_died(wait_s=2.0):  # a collective failed because a rank died
                self._noticed.set()
                raise WorkerDied(self.failed) from e
            raise
        finally:
            self._in_step = False

    def check(self) -> None:
        """Raise WorkerDied if any rank is gone."""
        if self.failed is not None:
            self._noticed.set()
            raise WorkerDied(self.failed)

    # ---- failure
    def _fail(self, why: str) -> str:
        if self.failed is None:
            self.failed = why
            log.error("%s: the instance stops", why)
            for p in self._procs:
                p.kill()
            self.wake()
        return self.failed

    def _worker_died(self, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            for p in self._procs:
                code = p.exit_code()
                if code is not None:
                    self._fail(f"tensor-parallel rank {p.rank} died (exit code {code})")
            if self.failed is not None or time.monotonic() >= deadline:
                return self.failed is not None
            time.sleep(0.05)

    def _watch(self) -> None:
        """Queue the workers' reports; wait for any worker's exit, then fail the instance and make sure the engine
        thread is not left blocked."""
        sentinels = {p.sentinel: p for p in self._procs if p.sentinel is not None}
        reports = [p.reports for p in self._procs if p.reports is not None]
        while True:
            ready = wait(list(sentinels) + reports + [self._stop_r],
                         timeout=None if len(sentinels) == len(self._procs) else 0.5)
            if self._stop_r in ready or self._closed:
                return
            for c in [c for c in reports if c in ready]:
                try:
                    self._report(c.recv())
                except (EOFError, OSError):  # the worker ended: its sentinel tells
                    reports.remove(c)
                except Exception:  # an object this process cannot unpickle: that report only is lost
                    log.exception("dropped a report from a tensor-parallel rank")
            dead = [p for p in self._procs if p.exit_code() is not None]
            if dead:
                break
        p = dead[0]
        self._fail(f"tensor-parallel rank {p.rank} (pid {p.popen.pid}) died (exit code {p.exit_code()})")
        if self.device.type == "cuda":  # a rank blocked in an NCCL collective with the dead one never returns
            destroy_group(self.tp)
        if self._noticed.wait(FAIL_GRACE_S) or not self._in_step or self._closed:
            return
        log.critical("the engine stayed blocked %.0f s after a tensor-parallel rank died: exiting", FAIL_GRACE_S)
        logging.shutdown()
        os._exit(70)

    # ---- shutdown
    def close(self) -> None:
        """Stop every worker and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
        if self._watcher is not None:
            self._watcher.join(STOP_TIMEOUT_S)
        self._finalizer()
        self._unpin()
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)

    def _unpin(self) -> None:
        if self._restore_cpu is not None:
            cpus, threads = self._restore_cpu
            self._restore_cpu = None
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(threads)


def _cleanup(procs: list[WorkerProcess], tp) -> None:
    """Workers stopped and the group left (close(), garbage collection or interpreter exit)."""
    stop_workers(procs, STOP_TIMEOUT_S)
    procs.clear()
    if tp is not None:
        destroy_group(tp)

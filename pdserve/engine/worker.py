"""One tensor-parallel rank: its model shard, KV pool and ModelRunner (`Worker`), and the process that runs ranks
1..N-1 (`python -m pdserve.engine.worker FD REPORT_FD`). Rank 0's Worker lives in the engine core's process and is driven
directly; see pdserve.engine.executor for rank 0's side of the protocol.

Protocol, over one socket pair per worker (rank 0 -> worker: `send_bytes` frames that start with an int64 tag):
- TAG_STEP: a `StepPlan` as a flat int64 buffer. The worker runs the step; nothing comes back (the step's
  collectives keep the ranks together). A failed step is fatal: the worker reports `WorkerFailed` and exits.
- TAG_CONTROL: an int64 call id (0 unless a Call), then a pickled message: `WorkerInit` (first), `Call` (answered
  by one `CallResult`, an error one if it cannot even be unpickled there), `Stop`.
Worker -> rank 0: pickled `WorkerHello` (started, device set), `WorkerReady` (joined the process group) or
`WorkerFailed`, then one `CallResult` per `Call`. A second, one-way pipe carries the rank's reports (`Worker.report`:
pickled objects sent from any thread of the worker, e.g. a KV agent's, at any time); rank 0's executor queues them
for `take_reports` and wakes the engine loop.

A worker exits when rank 0 sends Stop, closes the pipe, or its process ends (a watcher thread on the parent's pidfd
ends the worker even while it is blocked inside a collective).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.engine.parent_watch import exit_with_parent
from pdserve.engine.runner import ModelRunner
from pdserve.engine.step_inputs import StepPlan
from pdserve.gc_heap import freeze_startup_heap
from pdserve.model.loader import ModelSource, build_model
from pdserve.ops.attention.plan_watch import WATCH as PLANS
from pdserve.ops.jit_watch import WATCH
from pdserve.parallel.group import TPGroup, init_group, tp_context
from pdserve.parallel.ranges import kv_head_range

log = logging.getLogger(__name__)

TAG_STEP = 0x53544550  # "STEP"
TAG_CONTROL = 0x43544C00  # "CTL"
INIT_TIMEOUT_S = 60.0  # a started worker waits this long for its WorkerInit


# ---- messages


@dataclass(frozen=True)
class WorkerInit:
    rank: int
    size: int
    config: EngineConfig
    hf_config: object
    source: ModelSource
    dtype: torch.dtype
    device: str  # "cuda:N" or "cpu"
    store_port: int  # rank 0's rendezvous store
    timeout_s: float  # of the rendezvous and of every collective
    parent_pid: int
    cpus: tuple[int, ...] = ()  # CPU only: the cores this rank's threads run on


@dataclass(frozen=True)
class WorkerHello:
    rank: int
    pid: int


@dataclass(frozen=True)
class WorkerReady:
    rank: int


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    message: str
    traceback: str = ""


@dataclass(frozen=True)
class Call:
    """Run `method` on the worker: a Worker method's name, or a picklable function called as fn(worker, ...)."""

    call_id: int
    method: str | Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CallResult:
    call_id: int
    rank: int
    value: object = None
    error: str | None = None
    traceback: str = ""


@dataclass(frozen=True)
class Stop:
    pass


def control_frame(msg: object) -> bytes:
    call_id = msg.call_id if isinstance(msg, Call) else 0
    return (TAG_CONTROL.to_bytes(8, "little") + call_id.to_bytes(8, "little")
            + pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def step_frame(plan: StepPlan) -> np.ndarray:
    return plan.encode(TAG_STEP)


# ---- one rank


class Worker:
    """One rank's model shard, KV pool and runner. `extras` holds the state of functions that other layers run on
    every rank through the executor's collective_rpc (e.g. the PD code's per-rank KV agent); `report` sends an
    object to rank 0's executor from any thread (`Executor.take_reports`); `after_layer`, when set by such a
    function, is the per-layer callback of this rank's next step only (a layer-by-layer KV push)."""

    def __init__(self, config: EngineConfig, hf_config, source: ModelSource, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup, report: Callable[[object], None]):
        self.config = config
        self.hf_config = hf_config
        self.source = source
        self.dtype = dtype
        self.device = device
        self.tp = tp
        self.rank = tp.rank
        self.model = None
        self.runner: ModelRunner | None = None
        self.extras: dict = {}
        self.report = report
        self.after_layer: Callable[[int], None] | None = None
        self._mark = 0  # bytes allocated at mark_memory
        self.baseline_used = 0  # bytes in use on this rank's GPU when the engine opened it, not by this process's
        # PyTorch allocator: the CUDA context and other processes' memory (not the engine's; pool_budget)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)  # after the CUDA context is made
            self.baseline_used = max(0, total - free - torch.cuda.memory_reserved(device))
            WATCH.install()  # from here on: each kernel's specializations, so a later compile names what was new

    def call(self, method: str | Callable, args: tuple, kwargs: dict):
        fn = getattr(self, method) if isinstance(method, str) else functools.partial(method, self)
        return fn(*args, **kwargs)

    def load_model(self) -> None:
        torch.manual_seed(self.config.seed)
        with tp_context(self.tp):
            self.model = build_model(self.hf_config, self.source, self.device, self.dtype, self.config.load_format,
                                     self.config.seed)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of this rank's GPU; (0, 0) on CPU."""
        if self.device.type != "cuda":
            return 0, 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what loading left cached but unused (temporaries of the weights' init) is free
        return torch.cuda.mem_get_info(self.device)

    def release_cached(self) -> None:
        """Give the allocator's free cached blocks back to the device (CUDA; nothing on CPU), at the end of the
        engine's start: the warm-up's steps leave blocks cached that the KV sizing counted in no step's peak. A
        `pdserve serve` of dummy Qwen3-8B at 0.9 of an H200 had 1,190 MiB less in use after its first completion
        with it than without (nvidia-smi; two machines, benchmarks/lease_s32 s32c2 against s32c1). Blocks free
        beside live ones in a segment stay: the largest-step GPU test, which runs no warm-up, read the same 0.035
        GiB reserved beyond the allocated either way."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def arm_watchers(self) -> None:
        """Count and log the kernels Triton compiles (pdserve.ops.jit_watch) and the cuDNN attention plans torch builds
        (pdserve.ops.attention.plan_watch) from now on in this rank's process."""
        if self.device.type != "cuda":
            return
        if WATCH.install():
            WATCH.arm()  # installed at __init__: the warm-up's compiles are the comparison's base
        PLANS.arm()

    def freeze_heap(self) -> int:
        """This rank's process's start-up heap frozen out of the collector's scans (pdserve.gc_heap): only in a
        process the engine owns (the engine process calls it once ready); the objects frozen."""
        return freeze_startup_heap(f"tp-rank{self.rank}")

    def memory_in_use(self) -> tuple[int, int, int, int]:
        """(bytes PyTorch's tensors hold, bytes in use on this rank's GPU in all, bytes that were in use when the
        engine opened it, bytes PyTorch's allocator holds from the device); (0, 0, 0, 0) on CPU. The first two
        differ by what lives outside PyTorch (the CUDA context, loaded kernels, NCCL buffers) and by the allocator's
        free cached blocks (the last less the first)."""
        if self.device.type != "cuda":
            return 0, 0, 0, 0
        free, total = torch.cuda.mem_get_info(self.device)
        return (torch.cuda.memory_allocated(self.device), total - free, self.baseline_used,
                torch.cuda.memory_reserved(self.device))

    def init_runner(self, num_blocks: int, block_size: int, attention_backend: str,
                    kv_dtype: torch.dtype, probe: bool = False) -> dict:
        """This rank's pool and runner; a `probe` pool (pdserve.engine.memory_profile) is a plain torch tensor."""
        kv = self.config.kv_transfer
        self.runner = ModelRunner(self.model, self.hf_config, self.device, self.dtype, num_blocks, block_size,
                                  attention_backend, kv_dtype, self.tp.size,
                                  kv.pool_alloc if kv.disaggregated and not probe else "torch")
        if self.tp.size > 1:
            self.runner.tp_broadcast = self.tp.broadcast_from_first
        return self.kv_pool_info()

    def release_runner(self) -> None:
        """Drop this rank's runner and its pool (the KV sizing probe's), and give their memory back to the device."""
        self.runner = None
        gc.collect()
        self.release_cached()

    def mark_memory(self) -> None:
        """Start measuring a step's peak: the allocator gives its free cached blocks back to the device, and the
        device's peak statistics restart at what is allocated and reserved now. Emptied, the allocator must reserve
        the step's own segments as it will beside the real pool (made right after the probe, with almost nothing
        cached): where the probe's step reused blocks that loading had left cached, its reserved growth stayed
        within its allocated peak (0.506 GiB, dummy Qwen3-0.6B at 4096 tokens), while the same step beside the pool
        reserved 0.637 GiB and overran the gpu_memory_utilization share by 0.13 GiB on an H200
        (test_memory_profile, benchmarks/lease_s16)."""
        if self.device.type == "cuda":
            self.release_cached()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._mark = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def memory_peak(self) -> int:
        """What the step since `mark_memory` took at its peak (bytes; 0 on CPU, where the pool is sized from
        cpu_kv_cache_gb): the most it allocated above what was allocated then, or, where more, the most the
        allocator reserved from the device above what it held then. The second is the step's tensors with the
        allocator's rounding and fragmentation, what the step will take again beside the pool (measured from an
        emptied cache: mark_memory says why)."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        allocated, reserved = self._mark
        return max(torch.cuda.max_memory_allocated(self.device) - allocated,
                   torch.cuda.max_memory_reserved(self.device) - reserved)

    def capture_graphs(self, max_batch: int, max_model_len: int, max_tokens: int, emulate: bool = False) -> None:
        self.runner.capture_graphs(max_batch, max_model_len, max_tokens, emulate=emulate)

    def execute_plan(self, plan: StepPlan) -> None:
        hook, self.after_layer = self.after_layer, None
        self.runner.run_plan(plan, hook)

    def take_after_layer(self) -> Callable[[int], None] | None:
        """The callback set for this rank's next step (rank 0: the engine passes it to the step itself)."""
        hook, self.after_layer = self.after_layer, None
        return hook

    def kv_pool_info(self) -> dict:
        """This rank's KV pool: what a per-rank KV agent registers (the tensor itself is `self.runner.kv_cache`)."""
        kv = self.runner.kv_cache
        k0, k1 = kv_head_range(self.hf_config.num_key_value_heads, self.tp)
        return {"rank": self.rank, "device": str(kv.device), "shape": tuple(kv.shape), "strides": tuple(kv.stride()),
                "dtype": str(kv.dtype).removeprefix("torch."), "kv_heads": (k0, k1), "data_ptr": kv.data_ptr(),
                "nbytes": kv.numel() * kv.element_size()}

    def step_counts(self) -> dict:
        return dict(self.runner.step_counts)

    def fast_sums(self) -> int:
        """The all-reduces this rank took through symmetric memory (--tp-all-reduce symm_mem)."""
        return self.tp.fast.calls if self.tp.fast is not None else 0


# ---- the worker process


def cpu_slice(rank: int, size: int, cpus: list[int]) -> tuple[int, ...]:
    """The cores rank `rank` of `size` runs its threads on: an even share of `cpus` (one shared core when fewer)."""
    if len(cpus) >= size:
        return tuple(cpus[rank::size])
    return (cpus[rank % len(cpus)],)


def pin_cpus(cpus: tuple[int, ...]) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    if cpus:
        torch.set_num_threads(len(cpus))


def _recv_control(conn: Connection):
    buf = conn.recv_bytes()
    if int.from_bytes(buf[:8], "little") != TAG_CONTROL:
        raise RuntimeError("expected a control message from rank 0")
    return pickle.loads(memoryview(buf)[16:])


def serve(worker: Worker, conn: Connection) -> int:
    """The worker's loop: steps and calls from rank 0 until Stop or rank 0 goes away. The exit code."""
    rank = worker.rank
    while True:
        try:
            buf = conn.recv_bytes()
        except (EOFError, OSError):
            return 0  # rank 0 went away
        tag = int.from_bytes(buf[:8], "little")
        if tag == TAG_STEP:
            try:
                worker.execute_plan(StepPlan.decode(np.frombuffer(buf, dtype=np.int64)[1:]))
            except BaseException as e:  # the ranks no longer agree: fatal, rank 0 fails the instance
                log.exception("rank %d: step failed", rank)
                _send_quietly(conn, WorkerFailed(rank, f"step failed: {type(e).__name__}: {e}", traceback.format_exc()))
                return 1
            continue
        if tag != TAG_CONTROL:
            _send_quietly(conn, WorkerFailed(rank, f"unknown frame tag {tag:#x}"))
            return 1
        call_id = int.from_bytes(buf[8:16], "little")
        try:
            msg = pickle.loads(memoryview(buf)[16:])
        except Exception as e:  # e.g. a function this process cannot import: that call fails, not the worker
            if not call_id:
                raise
            conn.send(CallResult(call_id, rank, None, f"the call could not be unpickled here: {type(e).__name__}: {e}"))
            continue
        if isinstance(msg, Stop):
            return 0
        if not isinstance(msg, Call):
            _send_quietly(conn, WorkerFailed(rank, f"unexpected message {type(msg).__name__}"))
            return 1
        try:
            reply = CallResult(msg.call_id, rank, worker.call(msg.method, msg.args, msg.kwargs))
        except Exception as e:
            reply = CallResult(msg.call_id, rank, None, f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            conn.send(CallResult(msg.call_id, rank, None, f"the result could not be sent: {e}"))


def _send_quietly(conn: Connection, msg: object) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass


class ReportPipe:
    """A worker's side of the report pipe: `send` is safe from any thread; a closed pipe (rank 0 gone) drops it."""

    def __init__(self, fd: int):
        self.conn = Connection(fd, readable=False)
        self.lock = threading.Lock()

    def send(self, obj: object) -> None:
        with self.lock:
            try:
                self.conn.send(obj)
            except OSError:  # rank 0 went away: this process ends with it
                log.debug("report dropped: rank 0 is gone")


def main(fd: int, report_fd: int) -> int:
    conn = Connection(fd)
    reports = ReportPipe(report_fd)
    if not conn.poll(INIT_TIMEOUT_S):
        print("pdserve worker: no WorkerInit from rank 0", file=sys.stderr)
        return 2
    init: WorkerInit = _recv_control(conn)
    exit_with_parent(init.parent_pid)
    logging.basicConfig(level=init.config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s tp-rank{init.rank}: %(message)s")
    try:
        device = torch.device(init.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            pin_cpus(init.cpus)
        conn.send(WorkerHello(init.rank, os.getpid()))
        tp = init_group(init.rank, init.size, device, init.store_port, init.timeout_s,
                        all_reduce=init.config.tp_all_reduce, dtype=init.dtype)
        worker = Worker(init.config, init.hf_config, init.source, init.dtype, device, tp, reports.send)
        conn.send(WorkerReady(init.rank))
    except BaseException as e:
        log.exception("rank %d failed to start", init.rank)
        _send_quietly(conn, WorkerFailed(init.rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        return 1
    return serve(worker, conn)


if __name__ == "__main__":
    from pdserve.engine import worker as _module  # messages must pickle as pdserve.engine.worker's, not __main__'s

    code = _module.main(int(sys.argv[1]), int(sys.argv[2]))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a process group's destructor must not hang the exit

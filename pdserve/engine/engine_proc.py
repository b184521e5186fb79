"""The engine core's own process: a loop that takes typed messages from a pipe, steps the core while it has work,
and sends every step's outputs and PD events back. It sleeps only in `wait()` on its pipes, so a new request, an
abort or a KV arrival (the KV connector writes to the wake pipe) gets it going at once; with nothing to compute it
still wakes every second to watch the deadlines of blocks held for peers."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.messages import (
    AbortRequest,
    AddRequest,
    Bye,
    CoreOutput,
    EngineFailed,
    EngineReady,
    RemotePrefillDone,
    RemotePrefillFailed,
    Shutdown,
    StepOutputs,
    TokenizerIds,
)
from pdserve.engine.parent_watch import exit_with_parent

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0  # with nothing to compute: how often the loop wakes to check leases and quarantine deadlines


class _Stop(Exception):
    pass


class EngineLoop:
    def __init__(self, core: EngineCore, conn: Connection, wake_fd: int):
        self.core = core
        self.conn = conn
        self.wake_fd = wake_fd
        self.pending: list[CoreOutput] = []
        self.last_stats: dict | None = None
        self.fatal: BaseException | None = None  # the engine cannot go on (a tensor-parallel rank died)
        self.handlers = {AddRequest: self.on_add, AbortRequest: self.on_abort, RemotePrefillFailed: self.on_failed,
                         RemotePrefillDone: self.on_done, Shutdown: self.on_shutdown}

    def on_add(self, m: AddRequest) -> None:
        try:
            self.core.add_request(m.request_id, m.prompt_token_ids, m.params, m.kv)
        except Exception as e:  # a bad request ends that request only
            self.pending.append(CoreOutput(m.request_id, [], True, "error", f"{type(e).__name__}: {e}"))

    def on_abort(self, m: AbortRequest) -> None:
        self.core.abort_request(m.request_id)

    def on_failed(self, m: RemotePrefillFailed) -> None:
        self.pending += self.core.remote_prefill_failed(m.request_id, m.reason, m.peer_done)

    def on_done(self, m: RemotePrefillDone) -> None:
        self.core.remote_prefill_done(m.request_id)

    def on_shutdown(self, m: Shutdown) -> None:
        raise _Stop

    def run(self) -> None:
        wake = _FdWaitable(self.wake_fd)
        while True:
            ready = wait([self.conn, wake], timeout=0 if self.core.has_work() else IDLE_WAKE_S)
            if wake in ready:
                _drain(self.wake_fd)
            while self.conn.poll():
                msg = self.conn.recv()
                handler = self.handlers.get(type(msg))
                if handler is None:
                    log.error("unknown message %r from the server process: ignored", type(msg).__name__)
                    continue
                handler(msg)
            self.step()
            stats = self.core.stats()
            out = StepOutputs(self.pending, self.core.take_events(), stats if stats != self.last_stats else None)
            self.pending = []
            if out or out.stats is not None:
                self.conn.send(out)
                self.last_stats = stats
            if self.fatal is not None:  # every request got its error: now the process ends (health turns 503)
                raise self.fatal

    def step(self) -> None:
        if not self.core.needs_step():
            return
        try:
            self.pending += self.core.step()
        except Exception as e:  # a failed step must not kill the instance silently: fail what ran, say why
            log.exception("engine step failed")
            for rid in list(self.core.scheduler.requests):
                self.core.abort_request(rid)
                self.pending.append(CoreOutput(rid, [], True, "error", f"engine step failed: {type(e).__name__}: {e}"))
            if getattr(e, "fatal", False):
                self.fatal = e


CLOSE_TIMEOUT_S = 30.0  # for closing the KV agent and the tensor-parallel ranks when the engine process ends


def end_process(cleanup: Callable[[], None] | None = None, timeout_s: float = CLOSE_TIMEOUT_S,
                code: int = 0) -> None:
    """Run `cleanup`, then end this process at once. Neither a cleanup that hangs (an NCCL teardown, a transfer
    thread) nor a thread left running nor an exit handler keeps the process, and its GPU memory, alive: a watchdog
    ends it `timeout_s` after the cleanup began."""
    def overdue() -> None:
        log.warning("closing the engine did not finish within %.0f s: exiting without it", timeout_s)
        _flush()
        os._exit(code)

    watchdog = threading.Timer(timeout_s, overdue)
    watchdog.daemon = True
    watchdog.start()
    try:
        if cleanup is not None:
            cleanup()
    except BaseException:
        log.exception("closing the engine failed")
    try:  # what a normal exit of a multiprocessing child runs first (its semaphores are unlinked, queues flushed)
        multiprocessing.util._exit_function()
    except Exception:
        log.exception("multiprocessing's exit hooks failed")
    _flush()
    os._exit(code)


def _flush() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


TOKENIZER_IDS_TIMEOUT_S = 300.0  # the server's tokenizer load, after the engine is built


def _await_tokenizer_ids(conn: Connection) -> frozenset[int]:
    if not conn.poll(TOKENIZER_IDS_TIMEOUT_S):
        raise TimeoutError(f"the server sent no tokenizer ids within {TOKENIZER_IDS_TIMEOUT_S:.0f} s")
    msg = conn.recv()
    if not isinstance(msg, TokenizerIds):
        raise RuntimeError(f"expected the tokenizer's ids first, got {type(msg).__name__}")
    return msg.eos_token_ids


def run_engine_process(config: EngineConfig, eos_ids: set[int] | None, conn: Connection) -> None:
    """The engine process's body; the process ends here (`end_process`), also when the server process is killed
    (its parent's end ends it: a SIGKILLed server no longer leaves an engine holding its GPU). `eos_ids` None: the
    server sends them (TokenizerIds) while the engine is being built; they are taken before EngineReady."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it shuts us down cleanly
    parent = multiprocessing.parent_process()  # the pid recorded at start: right even if the server already died
    if parent is not None:
        exit_with_parent(parent.pid)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    try:
        core = EngineCore(config, eos_token_ids=eos_ids, wake=lambda: os.write(wake_w, b"x"))
        if eos_ids is None:
            core.set_tokenizer_eos(_await_tokenizer_ids(conn))
        # this process and its workers are the engine's own: their start-up heaps leave the collector's scans
        frozen = core.executor.collective_rpc("freeze_heap")
        conn.send(EngineReady({
            "max_model_len": core.max_model_len,
            "num_blocks": core.kv.pool.num_blocks,
            "block_size": config.block_size,
            "device": str(core.device),
            "dtype": str(core.dtype).replace("torch.", ""),
            "vocab_size": core.hf_config.vocab_size,
            "kv": core.connector.describe() if core.connector is not None else None,
            "gc_frozen": frozen,
        }))
    except BaseException as e:  # report start-up failures to the parent instead of dying silently
        conn.send(EngineFailed(f"{type(e).__name__}: {e}", traceback.format_exc()))
        end_process(code=1)
    code = 0
    try:
        EngineLoop(core, conn, wake_r).run()
        conn.send(Bye())
    except _Stop:
        conn.send(Bye())
    except (EOFError, OSError):
        pass  # the server process went away
    except BaseException:
        log.exception("the engine loop ended")
        code = 1
    end_process(lambda: _close(core), code=code)


def _close(core: EngineCore) -> None:
    if core.connector is not None:
        core.connector.close()
    core.close()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class _FdWaitable:
    """Lets `multiprocessing.connection.wait` watch a raw pipe fd."""

    def __init__(self, fd: int):
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

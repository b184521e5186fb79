"""The engine core's own process: a loop that takes adds and aborts from a pipe, steps the core while it has work,
and sends every step's outputs back. It sleeps only in `wait()` on its pipes, so a new request, an abort or a KV
arrival (the disaggregation connector writes to the wake pipe) gets it going at once."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import CoreOutput, EngineCore

log = logging.getLogger(__name__)


def run_engine_process(config: EngineConfig, eos_ids: set[int], conn: Connection, role_options: dict | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it shuts us down cleanly
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s engine: %(message)s")
    try:
        core = EngineCore(config, eos_token_ids=eos_ids)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        if role_options and role_options.get("role", "both") != "both":
            from pdserve.disagg.connector import attach_connector

            attach_connector(core, role_options, wake=lambda: os.write(wake_w, b"x"))
        info = {
            "max_model_len": core.max_model_len,
            "num_blocks": core.kv.pool.num_blocks,
            "block_size": config.block_size,
            "device": str(core.device),
            "dtype": str(core.dtype).replace("torch.", ""),
            "vocab_size": core.hf_config.vocab_size,
            "kv": core.connector.describe() if core.connector is not None else None,
        }
        conn.send(("ready", info))
    except BaseException as e:  # report start-up failures to the parent instead of dying silently
        conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    wake_conn = _FdWaitable(wake_r)
    last_stats = None
    while True:
        busy = core.has_work()
        ready = wait([conn, wake_conn], timeout=0 if busy else 1.0)
        if wake_conn in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        outputs: list[CoreOutput] = []
        try:
            while conn.poll():
                msg = conn.recv()
                kind = msg[0]
                if kind == "add":
                    _, rid, ids, params, pd = msg
                    try:
                        if pd and core.connector is not None:
                            core.connector.add_request(core, rid, ids, params, pd)
                        else:
                            core.add_request(rid, ids, params)
                    except Exception as e:  # bad request: report it as that request's end
                        outputs.append(CoreOutput(rid, [], True, "error", f"{type(e).__name__}: {e}"))
                elif kind == "abort":
                    core.abort_request(msg[1])
                elif kind == "call":  # connector RPCs from the server process (e.g. a prefill order)
                    _, call_id, name, args = msg
                    try:
                        result = getattr(core.connector, name)(core, *args)
                        conn.send(("reply", call_id, True, result))
                    except Exception as e:
                        conn.send(("reply", call_id, False, f"{type(e).__name__}: {e}"))
                elif kind == "shutdown":
                    if core.connector is not None:
                        core.connector.close()
                    conn.send(("bye",))
                    return
        except (EOFError, OSError):
            if core.connector is not None:
                core.connector.close()
            return  # the server process went away
        try:
            if core.has_work() or (core.connector is not None and core.connector.has_events()):
                outputs.extend(core.step())
        except Exception as e:  # a failed step must not kill the instance silently: fail what ran, say why
            log.exception("engine step failed")
            for rid in list(core.requests):
                core.abort_request(rid)
                outputs.append(CoreOutput(rid, [], True, "error", f"engine step failed: {type(e).__name__}: {e}"))
        stats = core.stats()
        if outputs or stats != last_stats:
            try:
                conn.send(("outputs", outputs, stats, time.time()))
            except (BrokenPipeError, OSError):
                return
            last_stats = stats


class _FdWaitable:
    """Lets `multiprocessing.connection.wait` watch a raw pipe fd."""

    def __init__(self, fd: int):
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

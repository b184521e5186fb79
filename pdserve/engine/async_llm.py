"""The asyncio face of the engine for the server: the core runs in its own process, this side tokenizes,
detokenizes and streams, so the HTTP event loop never waits on a GPU step and a step never waits on HTTP.

Interface: `generate` (a request's output stream; `kv=ImportParams` for a decode instance's remote prefill),
`export` (prefill role: compute a prompt and push its KV to a decode instance), `abort`, the control calls of the
decode side (`remote_prefill_failed`, `remote_prefill_done`), and two subscriptions for layers built on top:
`add_event_listener` (the engine's PD events) and `add_output_hook` (see or annotate each output before its stream
gets it). Nothing else reaches into it.

Every message arrives through one pipe read by a blocking reader thread and handed to the event loop (no polling);
every message to the engine leaves through a writer thread (pipe_writer.py), so a full pipe never blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.messages import (
    AbortRequest,
    AddRequest,
    Bye,
    CoreOutput,
    EngineFailed,
    EngineReady,
    ExportFinished,
    ExportParams,
    ImportParams,
    KVDestination,
    PDEvent,
    RemotePrefillDone,
    RemotePrefillFailed,
    Shutdown,
    StepOutputs,
    TokenizerIds,
)
from pdserve.engine.output_processor import RequestState
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.pipe_writer import PipeWriter
from pdserve.errors import EngineDead, PromptTooLong, QueueFull
from pdserve.sampling_params import SamplingParams
from pdserve.validation import check_prompt_len

log = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDead", "PromptTooLong", "QueueFull", "RequestInfo"]


@dataclass(frozen=True)
class RequestInfo:
    """What the client side knows of a running request (read-only for layers on top)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: ImportParams | None
    arrival_time: float


@dataclass
class _Stream:
    info: RequestInfo
    state: RequestState
    queue: asyncio.Queue


class AsyncLLM:
    def __init__(self, config: EngineConfig, start_timeout_s: float = 900.0):
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.tokenizer = None
        self.max_model_len: int = 0
        self.info: dict = {}
        self._proc: mp.Process | None = None
        self._conn = None
        self._writer: PipeWriter | None = None
        self._streams: dict[str, _Stream] = {}
        self._exports: dict[str, asyncio.Future] = {}
        self._stats: dict = {}
        self._adds_since_stats = 0
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event_listeners: list[Callable[[PDEvent], None]] = []
        self._output_hooks: list[Callable[[str, RequestOutput], None]] = []
        self._closed_listeners: list[Callable[[str], None]] = []
        self.last_output_time = 0.0

    @property
    def model_name(self) -> str:
        return self.config.name

    async def start(self) -> None:
        from pdserve.engine.engine_proc import run_engine_process
        from pdserve.engine.tokenizer import Tokenizer
        from pdserve.model.dummy_tokenizer import tokenizer_path_for
        from pdserve.model.loader import resolve_model

        self._loop = asyncio.get_running_loop()
        src = await asyncio.to_thread(resolve_model, self.config.model)
        tok_path = self.config.tokenizer or await asyncio.to_thread(tokenizer_path_for, src)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        # the engine builds its model while this process loads the tokenizer; the ids follow (TokenizerIds)
        self._proc = ctx.Process(target=run_engine_process, name="pdserve-engine", daemon=True,
                                 args=(self.config, None, child))
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            self.tokenizer = await asyncio.to_thread(Tokenizer.load, tok_path)
        except BaseException:
            self._proc.kill()
            raise
        try:
            parent.send(TokenizerIds(frozenset(self.tokenizer.eos_token_ids)))
        except OSError:  # the engine already ended: its EngineFailed (or its exit) is read below
            pass
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if await asyncio.to_thread(parent.poll, 0.1):
                msg = parent.recv()
                if isinstance(msg, EngineReady):
                    self.info = msg.info
                    break
                if isinstance(msg, EngineFailed):
                    self._proc.join(5)
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise TimeoutError(f"the engine did not start within {self.start_timeout_s:.0f} s")
        self.max_model_len = self.info["max_model_len"]
        # a blocking reader thread, not loop.add_reader: uvloop makes a watched fd non-blocking, and a message
        # larger than the pipe's buffer (hundreds of streams' outputs) would then arrive torn
        self._reader = threading.Thread(target=self._read_pipe, name="pdserve-engine-reader", daemon=True)
        self._reader.start()
        loop = self._loop
        self._writer = PipeWriter(parent, lambda e: loop.is_closed() or loop.call_soon_threadsafe(
            self._on_dead, f"the engine process stopped ({type(e).__name__})"))

    # ---- subscriptions
    def add_event_listener(self, callback: Callable[[PDEvent], None]) -> None:
        """`callback(event)` on the event loop for every PD event (KVReserved, KVAdmitted, KVFallback, ...)."""
        self._event_listeners.append(callback)

    def add_output_hook(self, hook: Callable[[str, RequestOutput], None]) -> None:
        """`hook(request_id, output)` on the event loop for every output before its stream gets it."""
        self._output_hooks.append(hook)

    def add_closed_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(request_id)` when a stream is closed before its request finished (client gone, timeout)."""
        self._closed_listeners.append(callback)

    def request_info(self, request_id: str) -> RequestInfo | None:
        st = self._streams.get(request_id)
        return st.info if st is not None else None

    def request_ids(self) -> list[str]:
        return list(self._streams)

    # ---- engine pipe
    def _read_pipe(self) -> None:
        conn, loop = self._conn, self._loop
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError) as e:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self._on_dead, f"the engine process stopped ({type(e).__name__})")
                return
            if loop.is_closed():
                return
            loop.call_soon_threadsafe(self._on_message, msg)
            if isinstance(msg, Bye):
                return

    def _on_message(self, msg) -> None:
        if not isinstance(msg, StepOutputs):
            return
        try:
            if msg.stats is not None:
                self._stats = msg.stats
                self._adds_since_stats = 0
            self.last_output_time = time.time()
            for ev in msg.events:
                self._on_event(ev)
            for co in msg.outputs:
                self._dispatch(co)
        except Exception:
            log.exception("handling an engine message failed")

    def _on_event(self, ev: PDEvent) -> None:
        if isinstance(ev, ExportFinished):
            fut = self._exports.pop(ev.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(ev)
        for cb in self._event_listeners:
            try:
                cb(ev)
            except Exception:
                log.exception("a PD event listener failed on %s", type(ev).__name__)

    def _dispatch(self, co) -> None:
        fut = self._exports.get(co.request_id)
        if fut is not None:  # an export request that failed before its push (e.g. a bad prompt)
            if co.finished and not fut.done():
                self._exports.pop(co.request_id, None)
                fut.set_result(ExportFinished(co.request_id, None, str(co.stop_reason)))
            return
        st = self._streams.get(co.request_id)
        if st is None:
            return
        out = st.state.process(co)
        for hook in self._output_hooks:
            hook(co.request_id, out)
        st.queue.put_nowait(out)
        if out.finished and not co.finished:  # a stop string ended it: stop the core too
            self._send(AbortRequest(co.request_id))

    def _on_dead(self, why: str) -> None:
        if self._dead:
            return
        self._dead = why
        for st in self._streams.values():
            st.queue.put_nowait(EngineDead(why))
        for fut in self._exports.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))

    def _send(self, msg) -> None:
        """Queue `msg` for the engine process (the writer thread sends it; a broken pipe ends every stream through
        _on_dead)."""
        if self._dead:
            raise EngineDead(self._dead)
        self._writer.put(msg)

    # ---- requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt_len(len(prompt_token_ids), self.max_model_len, params.max_tokens)
        waiting = self._stats.get("num_waiting", 0) + self._adds_since_stats
        if waiting >= self.config.max_waiting:
            raise QueueFull(waiting, self.config.max_waiting)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv: ImportParams | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead:
            raise EngineDead(self._dead)
        if request_id in self._streams or request_id in self._exports:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        info = RequestInfo(request_id, list(prompt_token_ids), params, kv, time.time())
        stream = _Stream(info, RequestState(request_id, prompt_token_ids, params, self.tokenizer, info.arrival_time),
                         asyncio.Queue())
        self._streams[request_id] = stream
        finished = False
        try:
            self._send(AddRequest(request_id, info.prompt_token_ids, params, kv))
            self._adds_since_stats += 1
            while True:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._dead:
                try:
                    self._send(AbortRequest(request_id))
                except EngineDead:
                    pass
                for cb in self._closed_listeners:
                    cb(request_id)

    async def export(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     dest: KVDestination, timeout_s: float) -> ExportFinished:
        """Prefill role: compute the prompt and push its KV (and the first token) to `dest`; returns when the push
        ended (check `.error`). Cancelling the call aborts the request."""
        if self._dead:
            raise EngineDead(self._dead)
        if request_id in self._streams or request_id in self._exports:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        fut = self._loop.create_future()
        self._exports[request_id] = fut
        done = False
        try:
            self._send(AddRequest(request_id, list(prompt_token_ids), params, ExportParams(dest)))
            self._adds_since_stats += 1
            result = await asyncio.wait_for(fut, timeout_s)
            done = True
            return result
        finally:
            self._exports.pop(request_id, None)
            if not done and not self._dead:
                try:
                    self._send(AbortRequest(request_id))
                except EngineDead:
                    pass

    async def abort(self, request_id: str) -> None:
        st = self._streams.pop(request_id, None)
        if not self._dead:
            self._send(AbortRequest(request_id))
        if st is not None:  # the stream ends normally, with finish_reason "abort"
            st.queue.put_nowait(st.state.process(CoreOutput(request_id, [], True, "abort")))
            for cb in self._closed_listeners:
                cb(request_id)

    def remote_prefill_failed(self, request_id: str, reason: str, peer_done: bool) -> None:
        """Decode role: no prefill candidate delivered the KV (the engine recomputes or fails, by configuration)."""
        self._send(RemotePrefillFailed(request_id, reason, peer_done))

    def remote_prefill_done(self, request_id: str) -> None:
        """Decode role: the prefill peer of an aborted request answered: its quarantined blocks may be reused."""
        self._send(RemotePrefillDone(request_id))

    def stats(self) -> dict:
        s = dict(self._stats)
        s.setdefault("num_running", 0)
        s.setdefault("num_waiting", 0)
        s.setdefault("num_total_blocks", self.info.get("num_blocks", 0))
        s.setdefault("num_free_blocks", self.info.get("num_blocks", 0))
        s.setdefault("kv_usage", 0.0)
        s["num_streams"] = len(self._streams)
        s["engine_alive"] = self._dead is None and self._proc is not None and self._proc.is_alive()
        return s

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._proc is None:
            return
        if not self._dead and self._writer is not None:
            self._writer.put(Shutdown())
        self._dead = self._dead or "shut down"
        if self._writer is not None:
            await asyncio.to_thread(self._writer.close, timeout_s)
        await asyncio.to_thread(self._proc.join, timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)
        self._dead = self._dead or "shut down"
        for st in self._streams.values():
            st.queue.put_nowait(EngineDead("the engine is shutting down"))

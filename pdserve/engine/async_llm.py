"""The asyncio face of the engine for the server: the core runs in its own process, this side tokenizes,
detokenizes and streams, so the HTTP event loop never waits on a GPU step and a step never waits on HTTP.

Every output arrives through one pipe read by the event loop's reader callback (no polling thread, no sleeps).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.errors import EngineDead, PromptTooLong, QueueFull
from pdserve.engine.output_processor import RequestState
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDead", "PromptTooLong", "QueueFull"]


@dataclass
class _Stream:
    state: RequestState
    queue: asyncio.Queue
    pd: dict | None = None
    prompt_token_ids: list[int] | None = None


class AsyncLLM:
    def __init__(self, config: EngineConfig, role_options: dict | None = None, start_timeout_s: float = 900.0):
        self.config = config
        if role_options is None:
            from pdserve.disagg.instance import role_options as make_options

            role_options = make_options(config.kv_role, config.kv_host, config.kv_port, config.kv_transport,
                                        config.kv_lease_s, config.kv_fallback, config.kv_layerwise)
        self.role_options = role_options
        self.start_timeout_s = start_timeout_s
        self.tokenizer = None
        self.max_model_len: int = 0
        self.info: dict = {}
        self._proc: mp.Process | None = None
        self._conn = None
        self._streams: dict[str, _Stream] = {}
        self._stats: dict = {}
        self._adds_since_stats = 0
        self._dead: str | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_output_time = 0.0
        # disaggregation hooks (pdserve.disagg.instance installs them): control events of PD requests go here,
        # not into the client's stream
        self.pd_event_handler = None  # (request_id, event dict, stream) -> None
        self.pd_abort_handler = None  # (request_id) -> None
        self.pd_timings: dict[str, dict] = {}
        self.aliases: dict[str, str] = {}  # router request id -> engine request id

    @property
    def model_name(self) -> str:
        return self.config.name

    async def start(self) -> None:
        from pdserve.engine.tokenizer import Tokenizer
        from pdserve.model.loader import resolve_model

        self._loop = asyncio.get_running_loop()
        src = await asyncio.to_thread(resolve_model, self.config.model)
        from pdserve.model.dummy_tokenizer import tokenizer_path_for

        tok_path = self.config.tokenizer or await asyncio.to_thread(tokenizer_path_for, src)
        self.tokenizer = await asyncio.to_thread(Tokenizer.load, tok_path)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        from pdserve.engine.engine_proc import run_engine_process

        self._proc = ctx.Process(target=run_engine_process, name="pdserve-engine", daemon=True,
                                 args=(self.config, set(self.tokenizer.eos_token_ids), child, self.role_options))
        self._proc.start()
        child.close()
        self._conn = parent
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            ready = await asyncio.to_thread(parent.poll, 0.5)
            if ready:
                msg = parent.recv()
                if msg[0] == "ready":
                    self.info = msg[1]
                    break
                if msg[0] == "failed":
                    self._proc.join(5)
                    raise RuntimeError(f"the engine failed to start: {msg[1]}")
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
            if msg[0] == "bye":
                return

    def _on_message(self, msg) -> None:
        try:
            kind = msg[0]
            if kind == "outputs":
                _, outs, stats, _ts = msg
                self._stats = stats
                self._adds_since_stats = 0
                self.last_output_time = time.time()
                for co in outs:
                    self._dispatch(co)
            elif kind == "reply":
                _, cid, ok, result = msg
                fut = self._calls.pop(cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(result) if ok else fut.set_exception(RuntimeError(result))
        except Exception:
            log.exception("handling an engine message failed")

    def _dispatch(self, co) -> None:
        st = self._streams.get(co.request_id)
        if st is None:
            return
        ev = (co.extra or {}).get("pd_event")
        if ev is not None and self.pd_event_handler is not None:
            self.pd_event_handler(co.request_id, co.extra, st)
            if not co.new_token_ids and not co.finished:
                return
        out = st.state.process(co)
        if out.finished and co.request_id in self.pd_timings:
            out.pd_timings = self._public_timings(self.pd_timings.pop(co.request_id))
        st.queue.put_nowait(out)
        if out.finished and not co.finished:  # a stop string ended it: stop the core too
            self._send(("abort", co.request_id))

    @staticmethod
    def _public_timings(t: dict) -> dict:
        keys = ("queue_s", "prefill_s", "handover_s", "first_token_s", "prefill_url", "fallback", "fallback_reason",
                "num_cached_tokens", "push_s", "prefill_http_s")
        out = {k: t.get(k) for k in keys if k in t}
        out.setdefault("fallback", None)
        return out

    def _on_dead(self, why: str) -> None:
        if self._dead:
            return
        self._dead = why
        for st in self._streams.values():
            st.queue.put_nowait(EngineDead(why))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))

    def _send(self, msg) -> None:
        if self._dead:
            raise EngineDead(self._dead)
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            self._on_dead(f"the engine process stopped ({type(e).__name__})")
            raise EngineDead(self._dead) from e

    async def call(self, name: str, *args, timeout: float = 30.0):
        """Run a connector method in the engine process (disaggregation control messages)."""
        cid = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[cid] = fut
        self._send(("call", cid, name, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(cid, None)

    # ---- requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len or (params.max_tokens is not None and n + params.max_tokens > self.max_model_len):
            raise PromptTooLong(n, self.max_model_len, params.max_tokens)
        waiting = self._stats.get("num_waiting", 0) + self._adds_since_stats
        if waiting >= self.config.max_waiting:
            raise QueueFull(waiting, self.config.max_waiting)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       pd: dict | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead:
            raise EngineDead(self._dead)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        state = RequestState(request_id, prompt_token_ids, params, self.tokenizer)
        stream = _Stream(state, asyncio.Queue(), pd, list(prompt_token_ids))
        self._streams[request_id] = stream
        alias = (pd or {}).get("request_id")
        if alias:
            self.aliases[alias] = request_id
        finished = False
        try:
            self._send(("add", request_id, list(prompt_token_ids), params, pd))
            self._adds_since_stats += 1
            while True:
                out = await stream.queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self.pd_timings.pop(request_id, None)
            if alias:
                self.aliases.pop(alias, None)
            if not finished and not self._dead:
                try:
                    self._send(("abort", request_id))
                except EngineDead:
                    pass
                if pd and self.pd_abort_handler is not None:
                    self.pd_abort_handler(request_id)

    async def abort(self, request_id: str) -> None:
        st = self._streams.pop(request_id, None)
        if not self._dead:
            self._send(("abort", request_id))
        if st is not None:  # end the stream like any finished request (a CancelledError here was yielded, not raised)
            st.queue.put_nowait(RequestOutput(request_id, [], "", finished=True, finish_reason="abort",
                                              num_prompt_tokens=len(st.prompt_token_ids or [])))

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
        if not self._dead:
            self._dead = "shut down"
            try:
                self._conn.send(("shutdown",))
            except Exception:
                pass
        await asyncio.to_thread(self._proc.join, timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)
        self._dead = self._dead or "shut down"
        for st in self._streams.values():
            st.queue.put_nowait(EngineDead("the engine is shutting down"))

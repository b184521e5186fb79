"""Tokenization that never stalls the event loop for other requests.

Why a process: the `tokenizers` library holds the GIL while it encodes a long text (measured: 200k characters of
random letters held it 0.6 s, a 4 MB prompt 15 s), so a thread does not keep the server's event loop running;
health checks time out and every stream stalls. Texts up to `inline_chars` (a few milliseconds of work) are
encoded in a thread as before; longer ones go to a small process pool whose workers load the same tokenizer. Work
is bounded too: a prompt longer than max_model_len times the longest token (in characters) cannot fit the context
whatever it says, and is refused by the caller before anything tokenizes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing as mp
import os
import signal
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("pdserve.server")

INLINE_CHARS = 4096  # at most a few ms of encoding with the GIL held

# ---- worker side (module-level functions: they are pickled by name)
_WORKER_TOKENIZER: Any = None


def _worker_init(path: str, server_pid: int | None = None) -> None:
    global _WORKER_TOKENIZER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it shuts the pool down
    if server_pid is not None:  # a SIGKILLed server cannot shut the pool down: end with it
        from pdserve.engine.parent_watch import exit_with_parent

        exit_with_parent(server_pid)
    from pdserve.engine.tokenizer import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.load(path)


def _w_ready() -> bool:
    return _WORKER_TOKENIZER is not None


def _w_encode(text: str, add_special_tokens: bool) -> list[int]:
    return _WORKER_TOKENIZER.encode(text, add_special_tokens=add_special_tokens)


def _w_encode_chat(messages: list[dict], kwargs: dict, add_special_tokens: bool) -> list[int]:
    text = _WORKER_TOKENIZER.apply_chat_template(messages, **kwargs)
    return _WORKER_TOKENIZER.encode(text, add_special_tokens=add_special_tokens)


def _w_decode(ids: list[int], skip_special_tokens: bool) -> str:
    return _WORKER_TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)


def _w_token_strs(ids: list[int]) -> list[str | None]:
    return _WORKER_TOKENIZER.convert_ids_to_tokens(ids)


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token can stand for: its longest vocabulary entry (byte-level and SentencePiece
    entries are at least as long as the text they decode to). None when the tokenizer cannot say."""
    explicit = getattr(tokenizer, "max_token_chars", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    convert, size = getattr(tokenizer, "convert_ids_to_tokens", None), getattr(tokenizer, "vocab_size", None)
    if convert is None or not isinstance(size, int) or size <= 0:
        return None
    longest = max((len(t) for t in convert(range(size)) if t), default=0)
    return longest or None


class TokenizerService:
    """encode / encode_chat / decode / token_strs for one tokenizer, inline for small inputs, in worker processes
    for large ones (when the tokenizer can be reloaded from `tokenizer.name_or_path`)."""

    def __init__(self, tokenizer: Any, workers: int = 1, inline_chars: int = INLINE_CHARS,
                 timeout_s: float = 600.0):
        self.tok = tokenizer
        self.workers = workers
        self.inline_chars = inline_chars
        self.timeout_s = timeout_s  # bound on one call (TimeoutError; the caller answers 503)
        path = getattr(tokenizer, "name_or_path", None)
        self.path = path if isinstance(path, str) and path else None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.max_token_chars: int | None = None

    @property
    def uses_processes(self) -> bool:
        return self.workers > 0 and self.path is not None

    async def start(self) -> None:
        self.max_token_chars = await asyncio.to_thread(max_token_chars, self.tok)
        if self.uses_processes:
            self._pool = self._new_pool()
            asyncio.get_running_loop().run_in_executor(self._pool, _w_ready)  # start and load the workers now

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                                      initializer=_worker_init, initargs=(self.path, os.getpid()))

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _run(self, size: int, inline, worker, *args) -> Any:
        return await asyncio.wait_for(self._dispatch(size, inline, worker, *args), self.timeout_s)

    async def _dispatch(self, size: int, inline, worker, *args) -> Any:
        if self._pool is None or size <= self.inline_chars:
            return await asyncio.to_thread(inline, *args)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, worker, *args)
        except BrokenProcessPool:  # a worker died (OOM killer, ...): replace the pool, do this one in a thread
            log.warning("the tokenizer worker pool broke; starting a new one")
            self._pool = self._new_pool()
            return await asyncio.to_thread(inline, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        def inline(t: str, special: bool) -> list[int]:
            return list(self.tok.encode(t) if special else self.tok.encode(t, add_special_tokens=False))

        return await self._run(len(text), inline, _w_encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                          continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
        if continue_final_message:
            kwargs["continue_final_message"] = True

        def inline(msgs: list[dict], kw: dict, special: bool) -> list[int]:
            if not special:
                return list(self.tok.encode_chat(msgs, **kw))
            return list(self.tok.encode(self.tok.apply_chat_template(msgs, **kw), add_special_tokens=True))

        size = sum(len(m.get("content") or "") for m in messages)
        return await self._run(size, inline, _w_encode_chat, messages, kwargs, add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        def inline(i: list[int], skip: bool) -> str:
            return self.tok.decode(i, skip_special_tokens=skip)

        return await self._run(len(ids) * 4, inline, _w_decode, ids, skip_special_tokens)

    async def token_strs(self, ids: list[int]) -> list[str | None]:
        def inline(i: list[int]) -> list[str | None]:
            return list(self.tok.convert_ids_to_tokens(i))

        return await self._run(len(ids) * 4, inline, _w_token_strs, ids)

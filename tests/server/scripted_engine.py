"""A scripted engine with AsyncLLM's interface, for testing the HTTP layer's shapes and failure paths fast.

Why: the real engine is exercised by test_server_live.py; this one lets tests force what a real model cannot
be made to do on demand (a full queue, an engine error mid-stream, a request that never produces a token),
and it counts open requests exactly, so a leak in the server's abort path is caught.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.errors import EngineDead, PromptTooLong, QueueFull

VOCAB = 256
WORD = "abcdefghijklmnopqrstuvwxyz"


class ByteTokenizer:
    """One token per byte of UTF-8, so expected counts are computed, not typed."""

    vocab_size = VOCAB
    eos_token_ids = [0]
    max_token_chars = 1  # a character is at least one byte, so at least one token
    delay_s = 0.0  # a blocking pause per encode, standing in for a long prompt's tokenization

    def encode(self, text: str) -> list[int]:
        time.sleep(self.delay_s)
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and i == 0:
                raise ValueError("Conversation must start with a user or system message")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


class ScriptedLLM:
    """Generates WORD's letters one token per step; `mode` forces failures: queue_full, error_after, die_after, stall."""

    def __init__(self, max_model_len: int = 128, step_s: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.model_name = "scripted"
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.mode = ""
        self.open: set[str] = set()
        self.aborted: list[str] = []
        self.seen_kv: list = []

    def stats(self) -> dict:
        return {
            "num_running": len(self.open),
            "num_waiting": 0,
            "kv_usage": len(self.open) / 8,
            "num_free_blocks": 8 - len(self.open),
            "num_total_blocks": 8,
            "prefix_cache_queries": 10,
            "prefix_cache_hits": 4,
            "running_tokens": 0,
            "waiting_tokens": 0,
        }

    async def abort(self, request_id: str) -> None:
        if request_id in self.open:
            self.aborted.append(request_id)
        self.open.discard(request_id)

    async def generate(self, request_id, prompt_token_ids, sampling_params, kv=None):
        if self.mode == "queue_full":
            raise QueueFull(num_waiting=4096, limit=4096, retry_after_s=2)
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(len(prompt_token_ids), self.max_model_len)
        self.seen_kv.append(kv)
        self.open.add(request_id)
        arrival = time.time()
        try:
            n = sampling_params.max_tokens
            for i in range(n):
                if self.mode == "stall":
                    await asyncio.sleep(3600)
                await asyncio.sleep(self.step_s)
                if self.mode == "die_after" and i == 2:
                    raise EngineDead("the engine process stopped (EOFError)")
                if self.mode == "error_after" and i == 2:
                    self.open.discard(request_id)
                    yield RequestOutput(request_id, [], "", True, "error", error="device fell over")
                    return
                tok = ord(WORD[i % len(WORD)])
                lp = None
                if sampling_params.logprobs is not None:
                    top = [(tok, -0.25), (tok + 1, -1.5)][: sampling_params.logprobs]
                    lp = [TokenLogprob(tok, -0.25, top)]
                last = i == n - 1
                if last:
                    self.open.discard(request_id)
                yield RequestOutput(
                    request_id,
                    [tok],
                    chr(tok),
                    finished=last,
                    finish_reason="length" if last else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=i + 1,
                    logprobs=lp,
                    arrival_time=arrival,
                    first_scheduled_time=arrival,
                    first_token_time=time.time() if i == 0 else None,
                )
        finally:
            if request_id in self.open:
                self.open.discard(request_id)
                self.aborted.append(request_id)

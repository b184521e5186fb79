"""Prefix hashing for KV-aware routing: what the router remembers of what it sent where.

The router does not see instances' caches; it approximates them by remembering, per instance, the prefix chunks of
the prompts it routed there (an LRU set of chained chunk hashes). A chain hash of chunk i covers chunks 0..i, so one
set lookup per chunk finds the longest shared prefix, exactly like the engine's block hashing but over text
(model-agnostic, no tokenizer in the router).
"""

from __future__ import annotations

import json
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The text an instance will tokenize, rendered cheaply: completions' prompt, or chat messages in order.

    Exact rendering does not matter (the chat template is the instance's business); it only has to be a
    deterministic prefix-preserving function of the request so shared prefixes hash alike.
    """
    if path.endswith("/chat/completions"):
        parts = []
        for msg in body.get("messages") or []:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            if isinstance(content, list):  # OpenAI content parts (malformed ones are the instance's to refuse)
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"<|{msg.get('role', '')}|>{content if isinstance(content, str) else ''}")
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt[0]  # batched prompts: route by the first
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # token ids: render as text so each id costs ~chars_per_token characters, keeping estimates in scale
        return " ".join(map(str, prompt))
    return json.dumps(prompt, separators=(",", ":"))


def chunk_hashes(text: str | bytes, chunk_chars: int) -> list[int]:
    """Chained hashes of the full `chunk_chars`-sized chunks of `text` (a partial tail chunk is not cached).

    Python's own hash: SipHash over bytes with this process's random key (no one outside can aim collisions at
    it), and the router's prefix sets live in this process only. A 32k-token prompt's 2,048 chunks cost ~0.5 ms,
    where a chain of blake2b digests cost ~4 ms on the development VM."""
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    out: list[int] = []
    prev = 0x5BD1E995
    for start in range(0, len(data) - chunk_chars + 1, chunk_chars):
        prev = hash((prev, data[start : start + chunk_chars]))
        out.append(prev)
    return out


def token_ids(prompt: Any) -> array | None:
    """A completions prompt given as token ids, packed (int64), or None for anything else. Packing checks the
    types in C: a 32k-id prompt costs well under a millisecond, where rendering it as text cost ~10 ms."""
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], int):
        return None
    try:
        return array("q", prompt)
    except (TypeError, OverflowError):
        return None  # not all ints (the instance refuses it): hash its text form


@dataclass(frozen=True)
class PromptKey:
    """What routing knows of a prompt without tokenizing: its estimated length in tokens (exact for token ids)
    and the chained hashes of its chunks, each chunk worth `tokens_per_chunk` tokens."""

    est_tokens: int
    hashes: list[int]
    tokens_per_chunk: float


def prompt_key(path: str, body: dict[str, Any], chunk_chars: int, chars_per_token: float) -> PromptKey:
    """The routing key of one request's (first) prompt. Token-id prompts are hashed as packed ids, a chunk being
    the same number of tokens as a text chunk is estimated to hold; text prompts as UTF-8."""
    tokens_per_chunk = chunk_chars / chars_per_token
    ids = None if path.endswith("/chat/completions") else token_ids(body.get("prompt"))
    if ids is not None:
        per = max(1, round(tokens_per_chunk))
        return PromptKey(len(ids), chunk_hashes(ids.tobytes(), per * ids.itemsize), float(per))
    text = prompt_text(path, body)
    return PromptKey(math.ceil(len(text) / chars_per_token), chunk_hashes(text, chunk_chars), tokens_per_chunk)


class PrefixIndex:
    """LRU set of chunk hashes routed to one instance; `overlap` counts the leading chunks it holds."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("PrefixIndex capacity must be positive")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def overlap(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the instance restarted or was marked down: its cache is gone)."""
        self._lru.clear()

"""Prefix hashing for KV-aware routing: what the router remembers of what it sent where.

The router does not see instances' caches; it approximates them by remembering, per instance, the prefix chunks of
the prompts it routed there (an LRU set of chained chunk hashes). A chain hash of chunk i covers chunks 0..i, so one
set lookup per chunk finds the longest shared prefix, exactly like the engine's block hashing but over text
(model-agnostic, no tokenizer in the router).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
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


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """Chained hashes of the full `chunk_chars`-sized chunks of `text` (a partial tail chunk is not cached)."""
    data = text.encode("utf-8", "surrogatepass")
    out: list[bytes] = []
    prev = b""
    for start in range(0, len(data) - chunk_chars + 1, chunk_chars):
        prev = hashlib.blake2b(prev + data[start : start + chunk_chars], digest_size=16).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """LRU set of chunk hashes routed to one instance; `overlap` counts the leading chunks it holds."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("PrefixIndex capacity must be positive")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def overlap(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
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

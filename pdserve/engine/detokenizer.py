"""Incremental detokenization: turn a growing list of token ids into text deltas for streaming.

Why not decode each token alone: a SentencePiece token carries its leading space as "▁" that some decoders strip
at the start of a string, byte-fallback and byte-level BPE tokens can hold part of a multi-byte UTF-8 character,
and decoders may merge across tokens. Why not decode the whole output each step: that is O(n) per token.
So, as vLLM does, we decode a short window twice: `ids[prefix:read]` (text already emitted, plus a little left
context) and `ids[prefix:]`; the delta is what the second has beyond the first. A delta ending in U+FFFD is an
incomplete UTF-8 sequence: it is held back until a later token completes it (or `flush()` at the end).
"""

from __future__ import annotations

from typing import Protocol

# Left context decoded with each window: enough for a decoder to see the previous word boundary, as vLLM uses.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for the output tokens of one request. `push` costs two decodes of a few tokens."""

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt's tail is kept: it gives the first output token its left context (leading space).
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start: left context for the decoder
        self._read_offset = len(context)  # ids before this have been emitted as text
        self._parts: list[str] = []
        self._text_cache: str | None = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache

    def push(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text they complete (possibly "", while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD, as a full decode would)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        window = self._ids[self._prefix_offset:]
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not final):
            # Nothing new yet (e.g. a skipped special token) or a character still incomplete: hold.
            if final:
                self._prefix_offset = self._read_offset = len(self._ids)
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._parts.append(delta)
        self._text_cache = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

"""How engine output deltas become OpenAI chunks and responses, one class per endpoint.

Why separate from the handlers: the streaming loop is the same for both endpoints; only the shape of what is
written differs (`text` vs `delta`, legacy vs chat logprobs, the role chunk that opens a chat stream). A request
with several choices (n > 1, several prompts) has one `Choice` per choice index, each with its own state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pdserve import protocol as P
from pdserve.engine.outputs import RequestOutput


@dataclass
class Choice:
    """One choice of a response: its index, what it echoes, its logprob offsets and what it produced so far."""

    index: int
    echo_text: str = ""
    logprobs: P.CompletionLogprobs | None = None
    outs: list[RequestOutput] = field(default_factory=list)


class OutputFormat:
    chunk_object = ""

    def __init__(self, rid: str, model: str, tokenizer: Any, tokens_as_ids: bool = False):
        self.rid = rid
        self.model = model
        self.created = P.now()
        decode = tokenizer.decode
        if tokens_as_ids:  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
            self.token_text = lambda t: f"token_id:{t}"
        else:
            self.token_text = lru_cache(maxsize=4096)(lambda t: decode([t], skip_special_tokens=False))

    def new_choice(self, index: int, echo_text: str = "") -> Choice:
        return Choice(index, echo_text)

    def start_chunks(self, choice: Choice) -> list[dict]:
        return []

    def delta_chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def finish_chunk(self, choice: Choice, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def choice_body(self, choice: Choice) -> dict:
        raise NotImplementedError

    def response(self, choices: list[Choice], usage: dict) -> dict:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    chunk_object = "text_completion"

    def __init__(self, rid: str, model: str, tokenizer: Any, logprobs: int | None, tokens_as_ids: bool = False):
        super().__init__(rid, model, tokenizer, tokens_as_ids)
        self.want_logprobs = logprobs is not None

    def new_choice(self, index: int, echo_text: str = "") -> Choice:
        lp = P.CompletionLogprobs(self.token_text) if self.want_logprobs else None
        return Choice(index, echo_text, lp)

    def _chunk(self, choice: Choice, text: str, finish_reason: str | None, lp=None) -> dict:
        return P.completion_chunk(self.rid, self.created, self.model, text, finish_reason, lp, index=choice.index)

    def start_chunks(self, choice: Choice) -> list[dict]:
        return [self._chunk(choice, choice.echo_text, None)] if choice.echo_text else []

    def delta_chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        lp = choice.logprobs.chunk(out.logprobs) if choice.logprobs is not None and out.logprobs else None
        if not out.new_text and lp is None:
            return []
        return [self._chunk(choice, out.new_text, None, lp)]

    def finish_chunk(self, choice: Choice, finish_reason: str | None) -> dict:
        return self._chunk(choice, "", finish_reason)

    def choice_body(self, choice: Choice) -> dict:
        outs = choice.outs
        text = choice.echo_text + "".join(o.new_text for o in outs)
        lp = None
        if choice.logprobs is not None:
            lp = choice.logprobs.chunk([e for o in outs for e in (o.logprobs or [])])
        return P.completion_choice(choice.index, text, outs[-1].finish_reason if outs else None, lp)

    def response(self, choices: list[Choice], usage: dict) -> dict:
        body = [self.choice_body(c) for c in sorted(choices, key=lambda c: c.index)]
        return P.completion_response(self.rid, self.created, self.model, body, usage)


class ChatFormat(OutputFormat):
    chunk_object = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, tokenizer: Any, logprobs: bool, tokens_as_ids: bool = False):
        super().__init__(rid, model, tokenizer, tokens_as_ids)
        self.want_logprobs = logprobs

    def _logprobs(self, entries) -> dict | None:
        return P.chat_logprobs(entries or [], self.token_text) if self.want_logprobs else None

    def start_chunks(self, choice: Choice) -> list[dict]:
        delta = {"role": "assistant", "content": ""}
        return [P.chat_chunk(self.rid, self.created, self.model, delta, None, index=choice.index)]

    def delta_chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        if not out.new_text and not (self.want_logprobs and out.logprobs):
            return []
        delta = {"content": out.new_text}
        lp = self._logprobs(out.logprobs)
        return [P.chat_chunk(self.rid, self.created, self.model, delta, None, lp, index=choice.index)]

    def finish_chunk(self, choice: Choice, finish_reason: str | None) -> dict:
        return P.chat_chunk(self.rid, self.created, self.model, {}, finish_reason, index=choice.index)

    def choice_body(self, choice: Choice) -> dict:
        outs = choice.outs
        content = "".join(o.new_text for o in outs)
        lp = self._logprobs([e for o in outs for e in (o.logprobs or [])])
        return P.chat_choice(choice.index, content, outs[-1].finish_reason if outs else None, lp)

    def response(self, choices: list[Choice], usage: dict) -> dict:
        body = [self.choice_body(c) for c in sorted(choices, key=lambda c: c.index)]
        return P.chat_response(self.rid, self.created, self.model, body, usage)

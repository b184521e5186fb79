"""How engine output deltas become OpenAI chunks and responses, one class per endpoint.

Why separate from the handlers: the streaming loop is the same for both endpoints; only the shape of what is
written differs (`text` vs `delta`, legacy vs chat logprobs, the role chunk that opens a chat stream).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pdserve import protocol as P
from pdserve.engine.outputs import RequestOutput


class OutputFormat:
    chunk_object = ""

    def __init__(self, rid: str, model: str, tokenizer: Any):
        self.rid = rid
        self.model = model
        self.created = P.now()
        decode = tokenizer.decode
        self.token_text = lru_cache(maxsize=4096)(lambda t: decode([t], skip_special_tokens=False))

    def start_chunks(self) -> list[dict]:
        return []

    def delta_chunks(self, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def finish_chunk(self, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def response(self, outs: list[RequestOutput], usage: dict) -> dict:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    chunk_object = "text_completion"

    def __init__(self, rid: str, model: str, tokenizer: Any, echo_text: str, logprobs: int | None):
        super().__init__(rid, model, tokenizer)
        self.echo_text = echo_text
        self.logprobs = CompletionLogprobsOrNone(self.token_text, logprobs)

    def start_chunks(self) -> list[dict]:
        if not self.echo_text:
            return []
        return [P.completion_chunk(self.rid, self.created, self.model, self.echo_text, None)]

    def delta_chunks(self, out: RequestOutput) -> list[dict]:
        lp = self.logprobs.chunk(out)
        if not out.new_text and lp is None:
            return []
        return [P.completion_chunk(self.rid, self.created, self.model, out.new_text, None, lp)]

    def finish_chunk(self, finish_reason: str | None) -> dict:
        return P.completion_chunk(self.rid, self.created, self.model, "", finish_reason)

    def response(self, outs: list[RequestOutput], usage: dict) -> dict:
        text = self.echo_text + "".join(o.new_text for o in outs)
        lp = self.logprobs.whole(outs)
        return P.completion_response(self.rid, self.created, self.model, text, outs[-1].finish_reason, lp, usage)


class CompletionLogprobsOrNone:
    """The legacy logprobs object when asked for (`logprobs` set), else None in every chunk."""

    def __init__(self, token_text, k: int | None):
        self.acc = P.CompletionLogprobs(token_text) if k is not None else None

    def chunk(self, out: RequestOutput) -> dict | None:
        if self.acc is None or not out.logprobs:
            return None
        return self.acc.chunk(out.logprobs)

    def whole(self, outs: list[RequestOutput]) -> dict | None:
        if self.acc is None:
            return None
        return self.acc.chunk([e for o in outs for e in (o.logprobs or [])])


class ChatFormat(OutputFormat):
    chunk_object = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, tokenizer: Any, logprobs: bool):
        super().__init__(rid, model, tokenizer)
        self.want_logprobs = logprobs

    def _logprobs(self, entries) -> dict | None:
        return P.chat_logprobs(entries or [], self.token_text) if self.want_logprobs else None

    def start_chunks(self) -> list[dict]:
        return [P.chat_chunk(self.rid, self.created, self.model, {"role": "assistant", "content": ""}, None)]

    def delta_chunks(self, out: RequestOutput) -> list[dict]:
        if not out.new_text and not (self.want_logprobs and out.logprobs):
            return []
        delta = {"content": out.new_text}
        return [P.chat_chunk(self.rid, self.created, self.model, delta, None, self._logprobs(out.logprobs))]

    def finish_chunk(self, finish_reason: str | None) -> dict:
        return P.chat_chunk(self.rid, self.created, self.model, {}, finish_reason)

    def response(self, outs: list[RequestOutput], usage: dict) -> dict:
        content = "".join(o.new_text for o in outs)
        lp = self._logprobs([e for o in outs for e in (o.logprobs or [])])
        return P.chat_response(self.rid, self.created, self.model, content, outs[-1].finish_reason, lp, usage)

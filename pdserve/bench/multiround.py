"""Multi-round chat dataset: a shared system prompt and a growing per-user history (like LMCache's multi-round QA).

Every user's conversation starts with the same system prompt (shared across users) and a user-specific
history, then asks one question per round; round k's prompt carries all earlier questions and the answers the
server actually gave, so each round extends a prefix the server has seen before. That is what exercises
prefix caching. Round k of a user is sent no earlier than its arrival time *and* after round k-1 finished.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from pdserve.bench.datasets import BenchRequest, exact_length_text
from pdserve.bench.tokenizer import BenchTokenizer


@dataclass
class Conversation:
    """One user's state: texts fixed up front, answers filled in as rounds complete."""

    system: str
    history: str
    questions: list[str]
    chat: bool
    answers: list[str | None] = field(default_factory=list)
    done: list[asyncio.Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.answers = [None] * len(self.questions)
        self.done = [asyncio.Event() for _ in self.questions]

    def messages(self, rnd: int) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}]
        for k in range(rnd + 1):
            question = f"{self.history} {self.questions[0]}" if k == 0 else self.questions[k]
            msgs.append({"role": "user", "content": question})
            if k < rnd:
                msgs.append({"role": "assistant", "content": self.answers[k] or ""})
        return msgs

    def text(self, rnd: int) -> str:
        parts = [self.system, "\n\n"]
        for m in self.messages(rnd)[1:]:
            parts.append(("User: " if m["role"] == "user" else "Assistant: ") + m["content"] + "\n")
        parts.append("Assistant:")
        return "".join(parts)


@dataclass
class MultiRoundRequest(BenchRequest):
    conversation: Conversation | None = None
    round: int = 0
    tok: BenchTokenizer | None = None
    wait_timeout_s: float = 600.0

    async def materialize(self) -> BenchRequest:
        conv = self.conversation
        if self.round > 0:
            try:
                await asyncio.wait_for(conv.done[self.round - 1].wait(), self.wait_timeout_s)
            except asyncio.TimeoutError as e:
                raise TimeoutError(f"round {self.round - 1} of this conversation did not finish in time") from e
        if conv.chat:
            msgs = conv.messages(self.round)
            n = sum(self.tok.count(m["content"]) for m in msgs)
            return BenchRequest(prompt=None, messages=msgs, prompt_len=n, output_len=self.output_len)
        text = conv.text(self.round)
        return BenchRequest(prompt=text, prompt_len=self.tok.count(text), output_len=self.output_len)

    def complete(self, generated_text: str, success: bool) -> None:
        conv = self.conversation
        conv.answers[self.round] = generated_text if success else ""
        conv.done[self.round].set()


def multi_round_dataset(
    tok: BenchTokenizer,
    num_users: int,
    num_rounds: int,
    system_len: int,
    history_len: int,
    question_len: int,
    output_len: int,
    chat: bool,
    seed: int = 0,
    wait_timeout_s: float = 600.0,
) -> list[MultiRoundRequest]:
    """Requests ordered round by round (all users' round 0, then round 1, ...), as users take turns."""
    if min(num_users, num_rounds, question_len, output_len) < 1 or min(system_len, history_len) < 0:
        raise ValueError("multi-round users, rounds, question and output lengths must be >= 1; prompt lengths >= 0")
    rng = random.Random(seed)
    pool = tok.sampleable_ids()
    system = exact_length_text(tok, system_len, rng, pool)[0]
    convs = [
        Conversation(
            system=system,
            history=exact_length_text(tok, history_len, rng, pool)[0],
            questions=[exact_length_text(tok, question_len, rng, pool)[0] for _ in range(num_rounds)],
            chat=chat,
        )
        for _ in range(num_users)
    ]
    return [
        MultiRoundRequest(
            prompt=None, prompt_len=-1, output_len=output_len, conversation=c, round=r, tok=tok,
            wait_timeout_s=wait_timeout_s,
        )
        for r in range(num_rounds)
        for c in convs
    ]

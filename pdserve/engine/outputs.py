"""What the engine hands back for a request as it runs: deltas, so a stream never re-sends what it sent."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the previous output for this request
    new_text: str  # detokenized text for those tokens (may lag by a few tokens to keep UTF-8 whole)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or received from a prefill peer)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set when finish_reason == "error"
    # timings (time.time() seconds) for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    pd_timings: dict | None = None  # disaggregated requests, on the last output: queue/prefill/handover/first token

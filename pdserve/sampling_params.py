"""Per-request generation settings, validated once at the door so the engine never sees a bad value.

Ranges follow vLLM's SamplingParams: temperature in [0, 2] (values in (0, 0.01) are raised to 0.01 as vLLM does,
for numerical safety), top_p in (0, 1], top_k -1 or 0 (disabled) or positive, min_p in [0, 1], presence and
frequency penalties in [-2, 2], repetition_penalty finite and > 0, max_tokens >= 1, 0 <= min_tokens <= max_tokens,
seed within int64 (-1 means none), logit_bias values clamped to [-100, 100]. Integers must fit int64 so they can
become tensors; token ids are checked against the vocabulary by pdserve.validation, which knows its size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.validation import INT64_MAX, INT64_MIN, InvalidParameter

__all__ = ["InvalidParameter", "SamplingParams", "MAX_LOGPROBS", "MAX_STOP_STRINGS"]

MAX_LOGPROBS = 20  # OpenAI's and vLLM's default limit on top logprobs per token
MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: positive temperatures below it are raised to it
GREEDY_EPS = 1e-5
LOGIT_BIAS_LIMIT = 100.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per generated token (0: only the chosen one)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: divided if > 0, else multiplied
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # when set, only these tokens can be sampled

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.top_k == 0:
            self.top_k = -1
        if self.seed == -1:  # vLLM: -1 means "no seed"
            self.seed = None
        if _is_num(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.logit_bias is not None:
            self.logit_bias = self._convert_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    @staticmethod
    def _convert_logit_bias(bias: object) -> dict[int, float]:
        """Keys may be strings (JSON objects have string keys); values are clamped to [-100, 100] as vLLM does."""
        if not isinstance(bias, dict):
            raise InvalidParameter(f"logit_bias must be an object mapping token ids to numbers, got {bias!r:.80}",
                                   "logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                tid = key if _is_int(key) else int(str(key).strip(), 10)
            except ValueError:
                raise InvalidParameter(f"logit_bias keys must be token ids (integers), got {key!r:.40}",
                                       "logit_bias") from None
            if not _is_num(value) or not math.isfinite(value):
                raise InvalidParameter(f"logit_bias values must be finite numbers, got {value!r:.40}", "logit_bias")
            out[tid] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidParameter(f"{param} {msg}", param)

        def int64(param: str, value: object) -> None:
            if not _is_int(value):
                bad(param, f"must be an integer, got {value!r:.40}")
            if not INT64_MIN <= value <= INT64_MAX:  # type: ignore[operator]
                bad(param, f"must fit in a 64-bit signed integer, got {value}")

        def number(param: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
            if not _is_num(value) or not math.isfinite(value):  # type: ignore[arg-type]
                bad(param, f"must be a finite number, got {value!r:.40}")
            if value < lo or value > hi or (lo_open and value == lo):  # type: ignore[operator]
                bad(param, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}")

        if self.max_tokens is not None:
            int64("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        number("temperature", self.temperature, 0.0, 2.0)
        number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        int64("top_k", self.top_k)
        if self.top_k < -1:
            bad("top_k", f"must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        number("min_p", self.min_p, 0.0, 1.0)
        number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_num(self.repetition_penalty) or not math.isfinite(self.repetition_penalty):
            bad("repetition_penalty", f"must be a finite number, got {self.repetition_penalty!r:.40}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        if self.seed is not None:
            int64("seed", self.seed)
        if self.logprobs is not None:
            int64("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        int64("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "entries must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= INT64_MAX:
                bad("stop_token_ids", f"entries must be non-negative integers, got {t!r:.40}")
        for t in self.logit_bias or {}:
            if not 0 <= t <= INT64_MAX:
                bad("logit_bias", f"keys must be non-negative token ids, got {t}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty")
            for t in self.allowed_token_ids:
                if not _is_int(t) or not 0 <= t <= INT64_MAX:
                    bad("allowed_token_ids", f"entries must be non-negative integers, got {t!r:.40}")

"""Per-request generation settings, validated once at the door so the engine never sees a bad value."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A request parameter is out of range; the message names the parameter (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidParameter(f"{param} {msg}", param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 2.0):
            bad("temperature", f"must be in [0, 2], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not (0 <= self.logprobs <= 20)):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "entries must be non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "accepts at most 16 strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids", f"entries must be non-negative integers, got {t!r}")

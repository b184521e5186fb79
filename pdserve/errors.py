"""Errors the engine raises for requests it cannot take; each maps to one HTTP status in the server."""

from __future__ import annotations


class PromptTooLong(ValueError):
    """The prompt (plus the tokens asked for) does not fit the context (HTTP 400)."""

    def __init__(self, num_tokens: int, max_model_len: int, max_tokens: int | None = None):
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        if max_tokens is None or num_tokens >= max_model_len:
            msg = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                   f"{num_tokens} tokens. Please reduce the length of the prompt.")
        else:
            msg = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{num_tokens + max_tokens} tokens ({num_tokens} in the prompt, {max_tokens} for the completion). "
                   f"Please reduce the length of the prompt or max_tokens.")
        super().__init__(msg)


class QueueFull(RuntimeError):
    """The waiting queue is at its limit (HTTP 503 with Retry-After)."""

    def __init__(self, num_waiting: int, limit: int, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        super().__init__(f"the server is at capacity: {num_waiting} requests waiting (limit {limit}); retry later")


class EngineDead(RuntimeError):
    """The engine process stopped; no request can be served until the instance restarts (HTTP 503)."""

"""Checks of a request's token ids and lengths that the HTTP server and the engine both run.

Why one dependency-free module: the server refuses a bad request with a 400 before it reaches the engine, and the
engine (which offline users and the PD internal routes reach directly) runs the very same checks before a request
joins a batch, so nothing a client sends can fail an engine step. Importing this module costs nothing (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.errors import PromptTooLong

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class InvalidParameter(ValueError):
    """A request parameter is out of range; the message names the parameter (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_token_ids(ids: Iterable[int], vocab_size: int | None, what: str) -> None:
    """Every id must be an int in [0, vocab_size); `what` names the field in the error (prompt, stop_token_ids,
    logit_bias, allowed_token_ids). A vocab_size of None checks only that the ids are non-negative ints."""
    if isinstance(ids, (list, tuple)) and ids_in_range(ids, vocab_size):
        return  # the common case at C speed (a 32k-token prompt: well under a millisecond); else find the bad ones
    bad = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bad.append(t)
            if len(bad) == 5:
                break
    if bad:
        where = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
        raise InvalidParameter(f"{what} contains token ids outside the vocabulary {where}: {bad}", what)


def ids_in_range(ids: list | tuple, vocab_size: int | None) -> bool:
    """Whether every element is an int (not a bool) in [0, vocab_size) (vocab_size None: non-negative)."""
    if not ids:
        return True
    if set(map(type, ids)) != {int}:
        return False
    return min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size)


def check_prompt_len(num_tokens: int, max_model_len: int, max_tokens: int | None) -> None:
    """The prompt must be non-empty and leave room in the context: raises InvalidParameter (empty) or PromptTooLong
    (whose message names both numbers, as OpenAI words it)."""
    if num_tokens <= 0:
        raise InvalidParameter("prompt must not be empty", "prompt")
    if num_tokens >= max_model_len or (max_tokens is not None and num_tokens + max_tokens > max_model_len):
        raise PromptTooLong(num_tokens, max_model_len, max_tokens)


def check_request_token_ids(prompt_token_ids: Iterable[int], params, vocab_size: int | None) -> None:
    """The prompt and every token id a SamplingParams names (stop_token_ids, logit_bias keys, allowed_token_ids)."""
    check_token_ids(prompt_token_ids, vocab_size, "prompt")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    if params.logit_bias:
        check_token_ids(params.logit_bias.keys(), vocab_size, "logit_bias")
    if params.allowed_token_ids is not None:
        check_token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")

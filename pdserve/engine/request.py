"""A request as the engine core tracks it: tokens, how many have KV in the pool, and the blocks holding them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode side: blocks reserved, KV in flight from a prefill peer
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    token_ids: list[int] = field(init=False)  # prompt followed by output
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain over full blocks of token_ids
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = -1  # prompt tokens that were prefix-cache hits (set at first scheduling)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # disaggregation: set by the KV connector
    kv_export: dict | None = None  # prefill side: where to push the KV once computed
    kv_import: dict | None = None  # decode side: the KV arrives from a peer

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Apply the token-level stop rules after a new token; sets finish_reason. Stop strings live in the frontend."""
        p = self.params
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return True
            if last in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
                return True
        if p.max_tokens is not None and n_out >= p.max_tokens:
            self.finish_reason = "length"
            return True
        if self.num_tokens >= max_model_len:
            self.finish_reason = "length"
            return True
        return False

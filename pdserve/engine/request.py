"""A request as the engine core tracks it: tokens, how many have KV in the pool, and the blocks holding them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.messages import ExportParams, ImportParams, KVParams
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode side: KV to come from a prefill peer
    ADMITTED = "admitted"  # decode side: the peer's KV landed; waiting for a batch slot
    EXPORTING = "exporting"  # prefill side: computed; its blocks are held while the KV is pushed
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    token_ids: list[int] = field(init=False)  # prompt followed by output
    num_computed_tokens: int = 0  # tokens whose KV is in the pool (or is being written by a launched step)
    # async scheduling: the last `num_pending` entries of token_ids are placeholders -(row + 1) for tokens sampled
    # by launched steps and not yet on the host (Scheduler.launched appends them, Scheduler.collected fills them)
    num_pending: int = 0
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
    # disaggregation (the scheduler owns these states; see Scheduler.add_remote / start_export)
    kv: KVParams | None = None
    kv_deadline: float | None = None  # lease of the reservation (decode) or of the push (prefill)
    t_reserved: float | None = None  # decode side: when its blocks were reserved
    export_aborted: bool = False  # prefill side: aborted during the push; freed when the push stops
    kv_pushed_blocks: int = 0  # prefill side: destination blocks pushed ahead of the prompt's last chunk

    @property
    def kv_export(self) -> ExportParams | None:
        return self.kv if isinstance(self.kv, ExportParams) else None

    @property
    def kv_import(self) -> ImportParams | None:
        return self.kv if isinstance(self.kv, ImportParams) else None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def prompt_key(self) -> int:
        """Equal for equal prompts (the scheduler lets one of several identical prompts prefill for all)."""
        key = self.__dict__.get("_prompt_key")
        if key is None:
            key = self.__dict__["_prompt_key"] = hash(tuple(self.prompt_token_ids))
        return key

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

    def check_stop(self, max_model_len: int, upto: int | None = None) -> bool:
        """Apply the token-level stop rules after a new token — the last one, or the one at `upto - 1` when later
        entries are placeholders; sets finish_reason. Stop strings live in the frontend."""
        p = self.params
        n = len(self.token_ids) if upto is None else upto
        last = self.token_ids[n - 1]
        n_out = n - self.num_prompt_tokens
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
        if n >= max_model_len:
            self.finish_reason = "length"
            return True
        return False

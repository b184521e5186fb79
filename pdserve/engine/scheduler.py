"""Continuous batching: every step fills a token budget with running requests first (decodes and unfinished
prefill chunks), then admits waiting requests FCFS, chunking long prompts; when blocks run out the newest
running request is preempted and later recomputed."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 long_prefill_token_threshold: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # decode side: requests whose KV is in flight
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted_any = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                batch.preempted.append(victim)
                preempted_any = True
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            # req itself was preempted: the running list shrank to before it
        if not preempted_any:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                prefix_blocks: list[int] = []
                num_cached = 0
                if req.num_computed_tokens == 0 and not req.block_ids:
                    prefix_blocks, num_cached = self.kv.find_cached_prefix(req)
                n = min(req.num_tokens - num_cached, budget)
                if not self.kv.allocate(req, n, prefix_blocks):
                    if not self.running and not batch.requests:
                        # nothing will ever free a block: the prompt cannot fit the pool
                        self.waiting.popleft()
                        req.status = RequestStatus.FINISHED
                        req.finish_reason = "error"
                        req.stop_reason = (f"prompt of {req.num_tokens} tokens needs more KV blocks than the pool "
                                           f"has ({self.kv.pool.num_blocks} of {self.kv.block_size} tokens)")
                        batch.preempted.append(req)
                        continue
                    break
                self.waiting.popleft()
                req.num_computed_tokens = num_cached
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.time()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
        return batch

    def _preempt(self, req: Request) -> None:
        self.kv.reset_for_recompute(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str | None = None) -> None:
        """Take a request out of whichever queue holds it and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote.pop(req.request_id, None)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        if reason is not None:
            req.finish_reason = reason

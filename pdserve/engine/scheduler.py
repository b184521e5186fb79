"""Continuous batching, and the one owner of every request's state.

Every step fills a token budget with running requests first (decodes and unfinished prefill chunks), then admits
waiting requests FCFS, chunking long prompts; when blocks run out the newest running request is preempted and
later recomputed. Disaggregated requests have two more states, also changed only here:

- decode side, `WAITING_FOR_REMOTE_KV`: `add_remote` queues the request; `reserve_remote` gives it blocks (after a
  prefix-cache lookup, so only missing blocks travel); `admit_remote` marks the prompt computed when the peer's KV
  landed and the request joins the batch (`ADMITTED` until a batch slot is free); `fail_remote` sends it back to
  the waiting queue (recompute here) or ends it; blocks a peer may still write into go to quarantine.
- prefill side, `EXPORTING`: when an export request's first token is sampled, `update` takes it out of the batch
  and keeps its blocks while the KV is pushed; `end_export` frees them.

A step is accounted in two halves: `launched` when its forward and sampling were queued (its tokens count as
computed; each sampled row appends a placeholder id for the token to come), `collected` when its sampled ids reached
the host (placeholders filled, stop rules applied, finished requests ended); `update` is both at once. With async
scheduling the next step is scheduled between the two: a request decoding on a placeholder is an ordinary decode
row (position, slot and block of the next token accounted as usual; the runner fills its id on the device), and a
request that turns out to have finished has one extra token computed, which `collected` drops. While a step is in
flight (`defer_frees`), ended requests' blocks are retired rather than freed, and released once it is collected.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.messages import CoreOutput
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # prompts that can never fit the pool: ended with an error

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


@dataclass
class ExportStart:
    """A prefill-side request whose first token was just sampled: its KV is to be pushed now."""

    req: Request
    first_token: int
    logprob: tuple | None
    t_prefill_done: float


def failed_outputs(batch: ScheduledBatch) -> list[CoreOutput]:
    """The final outputs of the prompts `schedule` failed (they can never fit the pool)."""
    return [CoreOutput(r.request_id, [], True, "error", r.stop_reason, num_prompt_tokens=r.num_prompt_tokens)
            for r in batch.failed]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 lease_s: float = 30.0, max_long_prefill_tokens: int = 0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # while requests decode, a step takes at most this many tokens of prompts with more than this many left
        # (0: no limit but the step's budget); EngineConfig.max_long_prefill_tokens says why
        self.max_long_prefill_tokens = max_long_prefill_tokens
        self.max_model_len = max_model_len
        self.lease_s = lease_s  # how long blocks may stay reserved for, or held by, a remote peer
        self.requests: dict[str, Request] = {}  # every unfinished request, whatever its state
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # decode side: KV to come from a peer (unreserved or reserved)
        self._to_reserve: deque[Request] = deque()  # remote requests without blocks yet, in arrival order
        self._admitted: deque[Request] = deque()  # remote requests whose KV landed, waiting for a batch slot
        self.exporting: dict[str, Request] = {}  # prefill side: blocks held while pushed
        self._abandoned: list[str] = []  # prefill side: exports ended before their push (take_abandoned)
        self.num_preemptions = 0
        self.defer_frees = False  # a launched step is not collected yet: ended requests' blocks are retired

    # ---- questions
    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        """Whether a step would compute something."""
        return bool(self.running or self.waiting or self._admitted)

    def has_remote(self) -> bool:
        """Whether any request waits on a peer (deadlines to watch even when nothing computes)."""
        return bool(self.remote or self.exporting)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---- local requests
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        while self._admitted and len(self.running) < self.max_num_seqs:
            req = self._admitted.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        budget = self.max_num_batched_tokens
        long_left = self._long_prefill_allowance()
        preempted_any = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n, long_left = self._cap_long(req.num_tokens - req.num_computed_tokens, n, long_left)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running.pop()  # newest first
                if victim.kv_pushed_blocks:  # writes pushed ahead may still read its blocks: its export ends
                    self.running.append(victim)
                    self._abandon(victim)
                else:
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
            # identical prompts (n > 1 siblings, repeated prompts) share one prefill: a request whose prompt is being
            # prefilled by another waits for it, then takes its full blocks from the prefix cache
            sharing = self.kv.pool.enable_prefix_caching
            leaders = {r.prompt_key for r in self.running if r.num_computed_tokens < self._shareable(r)} \
                if sharing else set()
            followers: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.popleft()
                fresh = req.num_computed_tokens == 0 and not req.block_ids
                if fresh and req.prompt_key in leaders:
                    followers.append(req)
                    continue
                prefix_blocks: list[int] = []
                num_cached = 0
                if fresh:
                    prefix_blocks, num_cached = self.kv.find_cached_prefix(req)
                n, long_left = self._cap_long(req.num_tokens - num_cached, min(req.num_tokens - num_cached, budget),
                                              long_left)
                if n <= 0:  # a long prompt while the step's share of long prompts is taken: it starts next step
                    self.waiting.appendleft(req)
                    break
                if not self.kv.allocate(req, n, prefix_blocks):
                    if not batch.requests and not self._blocks_will_free():
                        # nothing will ever free a block: the prompt cannot fit the pool
                        self._end(req, "error", self._too_big(req))
                        batch.failed.append(req)
                        continue
                    self.waiting.appendleft(req)
                    break
                if sharing and num_cached < self._shareable(req):
                    leaders.add(req.prompt_key)  # siblings take its blocks from the cache once they are computed
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
            self.waiting.extendleft(reversed(followers))
        return batch

    def _long_prefill_allowance(self) -> int | None:
        """Tokens of long prompts this step may take: max_long_prefill_tokens while some running request decodes,
        else None (no limit but the budget)."""
        cap = self.max_long_prefill_tokens
        if cap <= 0:
            return None
        for r in self.running:
            if r.num_computed_tokens >= r.num_prompt_tokens:  # its prompt is in: it decodes (or ends) this step
                return cap
        return None

    def _cap_long(self, left: int, n: int, long_left: int | None) -> tuple[int, int | None]:
        """A request's tokens this step (`n`, within the budget) given `left` tokens still to compute: a prompt with
        more than max_long_prefill_tokens left takes at most what remains of the step's share of long prompts."""
        if long_left is None or left <= self.max_long_prefill_tokens:
            return n, long_left
        n = min(n, long_left)
        return n, long_left - n

    def _shareable(self, req: Request) -> int:
        """Prompt tokens a sibling can take from the prefix cache once computed: the full blocks, less the last
        token (its logits are always computed)."""
        return (req.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size

    def _blocks_will_free(self) -> bool:
        """Whether some block held now is released later without new requests (running, remote, exporting and
        quarantined ones all end by themselves)."""
        return bool(self.running or self._admitted or self.exporting or self.kv.quarantine or self.kv.retired) or any(
            r.block_ids for r in self.remote.values())

    def _too_big(self, req: Request) -> str:
        return (f"prompt of {req.num_tokens} tokens needs more KV blocks than the pool has "
                f"({self.kv.pool.num_blocks} of {self.kv.block_size} tokens)")

    def _preempt(self, req: Request) -> None:
        self.kv.reset_for_recompute(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, batch: ScheduledBatch, sampled: list[Request], token_ids: list[int], logprobs: list,
               now: float) -> tuple[list[CoreOutput], list[ExportStart]]:
        """After a step that was waited for: `launched` and `collected` at once, with the batch's failed requests."""
        self.launched(batch, sampled)
        outputs, exports = self.collected(sampled, token_ids, logprobs, now)
        return failed_outputs(batch) + outputs, exports

    def launched(self, batch: ScheduledBatch, sampled: list[Request]) -> None:
        """The step's forward and sampling are queued: its tokens count as computed (full blocks of known ids go to
        the prefix cache; the device writes them before any later step reads them), and each sampled row's request
        gets a placeholder -(row + 1) for its token to come."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.kv.cache_computed(req, req.num_tokens - req.num_pending)
        for j, req in enumerate(sampled):
            req.token_ids.append(-1 - j)
            req.num_pending += 1

    def collected(self, sampled: list[Request], token_ids: list[int], logprobs: list,
                  now: float) -> tuple[list[CoreOutput], list[ExportStart]]:
        """A launched step's sampled ids are on the host: each fills its request's oldest placeholder, the
        token-level stop rules apply, finished requests end (a placeholder launched after the token that finished
        one is dropped, never emitted); export requests leave the batch with their first token (their push
        starts). Rows of requests that ended meanwhile (a stop one step earlier, an abort) are dropped."""
        outputs: list[CoreOutput] = []
        exports: list[ExportStart] = []
        for req, tok, lp in zip(sampled, token_ids, logprobs):
            if req.is_finished:
                continue
            idx = req.num_tokens - req.num_pending
            req.token_ids[idx] = tok
            req.num_pending -= 1
            if req.first_token_time is None:
                req.first_token_time = now
            if req.kv_export is not None:
                self._start_export(req, now)
                exports.append(ExportStart(req, tok, lp, now))
                continue
            done = req.check_stop(self.max_model_len, idx + 1)
            outputs.append(CoreOutput(req.request_id, [tok], done, req.finish_reason if done else None,
                                      req.stop_reason if done else None,
                                      [lp] if req.params.logprobs is not None else None, req.num_prompt_tokens,
                                      max(req.num_cached_tokens, 0), req.first_scheduled_time))
            if done:
                del req.token_ids[idx + 1 :]  # the token a later step computed for it is not emitted
                req.num_pending = 0
                self._end(req)
        return outputs, exports

    def abort(self, request_id: str) -> Request | None:
        """Take a request out of whichever state holds it. Blocks a peer may still write into are quarantined;
        blocks a push may still read from stay held until `end_export`."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.EXPORTING:
            req.export_aborted = True  # freed when the push has stopped touching the blocks
            return req
        if req.kv_pushed_blocks and req.status in (RequestStatus.RUNNING, RequestStatus.WAITING):
            self._abandon(req)  # writes pushed ahead may still read its blocks
            return req
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KV and req.t_reserved is not None:
            self.remote.pop(request_id, None)
            self.kv.quarantine_request(req, time.time() + self.lease_s)
        self._end(req, "abort")
        return req

    def _end(self, req: Request, reason: str | None = None, message: str | None = None) -> None:
        """Out of every queue, blocks freed, finished."""
        st = req.status
        if st == RequestStatus.RUNNING:
            self.running.remove(req)
        elif st == RequestStatus.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        elif st == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote.pop(req.request_id, None)
            try:
                self._to_reserve.remove(req)
            except ValueError:
                pass
        elif st == RequestStatus.ADMITTED:
            self._admitted.remove(req)
        elif st == RequestStatus.EXPORTING:
            self.exporting.pop(req.request_id, None)
        if self.defer_frees:
            self.kv.retire(req)
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        if reason is not None:
            req.finish_reason = reason
        if message is not None:
            req.stop_reason = message

    # ---- decode side: requests whose prompt KV comes from a prefill peer
    def add_remote(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        self._to_reserve.append(req)

    def reserve_remote(self, now: float) -> tuple[list[Request], list[Request]]:
        """Give waiting remote requests their blocks, in arrival order, while the pool has room. Returns the newly
        reserved requests and those that can never fit (ended with an error)."""
        reserved: list[Request] = []
        failed: list[Request] = []
        while self._to_reserve:
            req = self._to_reserve[0]
            if (req.num_prompt_tokens + self.kv.block_size - 1) // self.kv.block_size > self.kv.pool.num_blocks:
                self._end(req, "error", self._too_big(req))
                failed.append(req)
                continue
            prefix_blocks, num_cached = self.kv.find_cached_prefix(req)
            if not self.kv.allocate(req, req.num_prompt_tokens - num_cached, prefix_blocks):
                break
            self._to_reserve.popleft()
            req.num_cached_tokens = num_cached
            req.t_reserved = now
            req.kv_deadline = now + self.lease_s
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            reserved.append(req)
        return reserved, failed

    def admit_remote(self, request_id: str, first_token: int, now: float) -> Request | None:
        """The peer's KV for the whole prompt landed: the prompt counts as computed, the first token is appended,
        and the request decodes from the next free batch slot. None when the request is not (or no longer)
        waiting for that KV."""
        req = self.remote.get(request_id)
        if req is None or req.t_reserved is None:
            return None
        del self.remote[request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed(req)  # the received full blocks serve later prefix hits too
        req.append_token(first_token)
        req.first_token_time = now
        req.kv_deadline = None
        if req.check_stop(self.max_model_len):
            self._end(req)
            return req
        req.status = RequestStatus.ADMITTED
        self._admitted.append(req)
        return req

    def fail_remote(self, request_id: str, recompute: bool, peer_done: bool, reason: str) -> Request | None:
        """The handover failed. Blocks a peer may still write into go to quarantine (`peer_done` False); the
        request is then recomputed here from its prompt (`recompute`) or ended with `reason`."""
        req = self.remote.pop(request_id, None)
        if req is None:
            return None
        if req.t_reserved is None:
            self._to_reserve.remove(req)
        elif peer_done:
            self.kv.free(req)
        else:
            self.kv.quarantine_request(req, time.time() + self.lease_s)
        req.num_computed_tokens = 0
        req.kv = None
        req.kv_deadline = None
        req.t_reserved = None
        if not recompute:
            self._end(req, "error", reason)
            return req
        req.status = RequestStatus.WAITING
        req.num_cached_tokens = -1
        self.waiting.appendleft(req)
        return req

    def expired_reservations(self, now: float) -> list[str]:
        return [rid for rid, r in self.remote.items() if r.kv_deadline is not None and now > r.kv_deadline]

    # ---- prefill side: requests whose KV is pushed to a decode instance
    def _start_export(self, req: Request, now: float) -> None:
        self.running.remove(req)
        req.status = RequestStatus.EXPORTING
        req.kv_deadline = now + self.lease_s
        self.exporting[req.request_id] = req

    def pushed_ahead(self, req: Request, num_blocks: int) -> None:
        """Prefill side: the request's first `num_blocks` destination blocks are being pushed ahead of its last
        chunk. From now on its blocks are freed only once those writes ended: an abort or a preemption before its
        push ends its export instead (`_abandon`)."""
        req.kv_pushed_blocks = num_blocks

    def _abandon(self, req: Request) -> None:
        """An export request with writes pushed ahead must stop (aborted, or preempted mid-prefill): it leaves the
        batch as an aborted export whose blocks stay held until every rank's writes ended (`end_export`); the
        engine has the connector wind them down (`take_abandoned`), and the decode side hears of it then."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.EXPORTING
        req.export_aborted = True
        req.kv_deadline = time.time() + self.lease_s
        self.exporting[req.request_id] = req
        self._abandoned.append(req.request_id)

    def take_abandoned(self) -> list[str]:
        """Exports `_abandon` ended since the last call: their pushed-ahead writes are to be wound down."""
        out, self._abandoned = self._abandoned, []
        return out

    def end_export(self, request_id: str) -> Request | None:
        """The push ended (landed, failed or cancelled): nothing reads these blocks any more."""
        req = self.exporting.get(request_id)
        if req is None:
            return None
        self._end(req, "abort" if req.export_aborted else None)
        return req

    def expired_exports(self, now: float) -> list[str]:
        return [rid for rid, r in self.exporting.items() if r.kv_deadline is not None and now > r.kv_deadline]

    def stats(self) -> dict:
        return {
            "num_running": len(self.running) + len(self._admitted),
            "num_waiting": len(self.waiting),
            "num_remote": len(self.remote),
            "num_exporting": len(self.exporting),
            "running_tokens": sum(r.num_tokens for r in self.running),
            "waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.waiting),
            "num_preemptions": self.num_preemptions,
        }

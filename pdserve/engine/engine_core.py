"""The engine core: owns the model, the KV pool and the scheduler, and advances every request one step at a time.
It runs in its own process (or inline for offline use and tests).

A step: take what the KV connector reports (disaggregated instances), schedule, launch the model (forward and
sampling queued on the device), collect the sampled ids, update the requests. The scheduler makes every state
change; the connector is only asked questions and handed pushes.

Async scheduling (`EngineConfig.async_scheduling`): one step stays in flight. `step()` schedules and launches step
n+1 while step n runs on the device, then collects step n and returns its outputs, so in steady decoding the host's
only wait is for step n's sampled ids (pdserve/engine/async_step.py says when a step is waited for at once instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.config import EngineConfig
from pdserve.engine.async_step import InFlight, async_supported, can_schedule_ahead, needs_history
from pdserve.engine.executor import Executor
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnector, KVPool, make_connector
from pdserve.engine.memory_profile import StepPeak, measure_step_peak, pool_budget
from pdserve.engine.messages import (
    CoreOutput,
    ExportFinished,
    ExportParams,
    ImportParams,
    KVAdmitted,
    KVFallback,
    KVParams,
    PDEvent,
)
from pdserve.engine.request import Request
from pdserve.engine.runner import block_bytes, kv_cache_torch_dtype
from pdserve.engine.scheduler import Scheduler, failed_outputs
from pdserve.engine.warmup import warm_up
from pdserve.kv.nvtx import mark, nvtx_range
from pdserve.model.loader import choose_dtype, load_config, resolve_model
from pdserve.ops.attention.plan_watch import WATCH as PLANS
from pdserve.ops.jit_watch import WATCH
from pdserve.parallel.ranges import kv_head_range
from pdserve.sampling_params import SamplingParams
from pdserve.stats import median
from pdserve.validation import check_prompt_len, check_request_token_ids

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but CUDA is not available on this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def eos_ids_from_config(cfg, tokenizer_eos: set[int] | None = None) -> frozenset[int]:
    ids: set[int] = set(tokenizer_eos or ())
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def skip_first_draw(req: Request, vocab_size: int, device: torch.device) -> None:
    """Decode side: the prefill peer sampled the first token with this request's seeded generator; advance ours by
    the same one draw so later tokens are those of a colocated run."""
    if req.generator is not None and not req.params.greedy:
        torch.empty(vocab_size, device=device).exponential_(generator=req.generator)


@dataclass
class HandoverStats:
    """Counters of the KV handover on this instance (for /load and /metrics)."""

    imports: int = 0
    fallbacks: int = 0
    exports: int = 0
    export_failures: int = 0
    handover_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        h = self.handover_s[-1000:]
        return {"imports": self.imports, "fallbacks": self.fallbacks, "exports": self.exports,
                "export_failures": self.export_failures, "handover_p50_s": median(h) if h else None}


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None,
                 wake: Callable[[], None] | None = None, kv_agent: object | None = None):
        self.config = config
        t0 = time.time()
        self.device = pick_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        source = resolve_model(config.model)
        self.hf_config, self.source = load_config(source)
        self.dtype = choose_dtype(config.dtype, self.device, self.hf_config)
        torch.manual_seed(config.seed)
        # every tensor-parallel rank (1 by default: this process only) with its model shard
        self.executor = Executor(config, self.hf_config, self.source, self.device, self.dtype, wake)
        self.model = self.executor.driver.model
        self.eos_token_ids = eos_ids_from_config(self.hf_config, eos_token_ids)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        bb = block_bytes(self.hf_config, config.block_size, kv_dtype, config.tensor_parallel_size)  # one rank's
        with self.executor.closing_on_error():
            model_max = int(getattr(self.hf_config, "max_position_embeddings", 8192))
            self.max_model_len = config.max_model_len or (model_max if self.device.type == "cuda"
                                                          else min(model_max, 8192))
            if self.max_model_len > model_max:
                raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit of {model_max} "
                                 f"positions")
            self.step_peak: StepPeak | None = None  # the KV sizing probe's measurement (CUDA)
            num_blocks = config.num_gpu_blocks or self._size_pool(bb, kv_dtype)
            self.block_bytes = bb
            # the same block ids index every rank's pool; the block accounting below stays here, on rank 0
            self.runner = self.executor.init_runner(num_blocks, config.block_size, config.attention_backend, kv_dtype)
            if not config.enforce_eager:
                self.executor.capture_graphs(min(config.max_num_seqs, 512), self.max_model_len,
                                             config.max_num_batched_tokens)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        kvt = config.kv_transfer
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   kvt.lease_s, config.max_long_prefill_tokens)
        self.num_steps = 0
        # totals for the server's periodic stats line: prompt tokens computed (prefix-cache hits are not), tokens
        # sampled, seconds in step() and, of those, seconds spent waiting for launched steps' sampled tokens
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "step_s": 0.0, "collect_wait_s": 0.0}
        self._events: list[PDEvent] = []
        self.handover = HandoverStats()
        pool = KVPool(self.runner.kv_cache, config.block_size, bb, num_blocks, self.hf_config.vocab_size, self.device,
                      self.hf_config.num_key_value_heads, kv_head_range(self.hf_config.num_key_value_heads,
                                                                        self.executor.tp))
        with self.executor.closing_on_error():  # a KV agent on every rank (prefill and decode roles)
            self.connector: KVConnector | None = make_connector(kvt, pool, wake or (lambda: None), self.executor,
                                                                kv_agent)
        self._inflight: InFlight | None = None
        # async scheduling: steps launched while the one before was in flight, and steps that had to wait for it
        self.async_counts = {"overlapped": 0, "waited": 0}
        self.async_scheduling = False
        self.set_async_scheduling(config.async_scheduling)
        self.warmup = None  # what the start-up warm-up ran
        if (self.device.type == "cuda") if config.warmup is None else config.warmup:
            with self.executor.closing_on_error():
                self.warmup = warm_up(self)
        self.executor.collective_rpc("release_cached")  # steps reserve from what is allocated, as the probe measured
        self.executor.collective_rpc("arm_watchers")  # kernels compiled, cuDNN plans built from here on: logged, counted
        log.info("engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens (%.1f MiB each), role %s",
                 time.time() - t0, config.model, self.device, self.dtype, num_blocks, config.block_size, bb / 2**20,
                 kvt.role)

    def _size_pool(self, bb: int, kv_dtype: torch.dtype) -> int:
        """Blocks of the KV pool: from cpu_kv_cache_gb on CPU; on CUDA, what gpu_memory_utilization leaves after the
        weights and the measured peak of the largest step (pdserve.engine.memory_profile)."""
        if self.device.type == "cpu":
            return max(16, int(self.config.cpu_kv_cache_gb * 2**30) // bb)
        cfg = self.config
        self.step_peak = measure_step_peak(self.executor, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                           self.max_model_len, cfg.block_size, cfg.attention_backend, kv_dtype,
                                           self.hf_config.vocab_size, self.eos_token_ids, block_bytes=bb)
        ranks = self.executor.pool_memory()
        budget = min(pool_budget(total, free, cfg.gpu_memory_utilization, self.step_peak.peak_bytes, base)
                     for free, total, _, base, _ in ranks)
        free, total, tensors, base, cached = min(ranks, key=lambda r: r[0])
        used = total - free
        log.info("KV sizing: %.2f GiB of %.2f GiB in use before the pool: %.2f GiB when the engine opened the GPU "
                 "(CUDA context, other processes: not counted, as in vLLM), %.2f GiB of tensors, %.2f GiB free in "
                 "PyTorch's cached blocks, %.2f GiB outside PyTorch; the pool gets %.2f GiB "
                 "at gpu_memory_utilization %.2f", used / 2**30, total / 2**30, base / 2**30, tensors / 2**30,
                 cached / 2**30, (used - base - tensors - cached) / 2**30, max(budget, 0) / 2**30,
                 cfg.gpu_memory_utilization)
        if budget < bb * 16:
            raise ValueError(f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after the "
                             f"weights and the largest step's {self.step_peak.peak_bytes / 2**30:.2f} GiB; raise "
                             f"--gpu-memory-utilization, lower --max-num-batched-tokens or use a smaller model")
        return int(budget // bb)

    # ---- requests
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """A checked request (pdserve.validation: the ids the prompt and the parameters name, the prompt's length)."""
        check_request_token_ids(prompt_token_ids, params, self.hf_config.vocab_size)
        check_prompt_len(len(prompt_token_ids), self.max_model_len, params.max_tokens)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return req

    def set_tokenizer_eos(self, eos_token_ids: set[int] | frozenset[int]) -> None:
        """The tokenizer's end-of-sequence ids, when they arrive after the engine was built (a server loads its
        tokenizer meanwhile): with the config's, they end every request added from now on."""
        self.eos_token_ids = eos_ids_from_config(self.hf_config, set(eos_token_ids))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv: KVParams | None = None) -> Request:
        """A new request; `kv` makes it an export (prefill role) or import (decode role) request."""
        if kv is not None and (self.connector is None or
                               (isinstance(kv, ExportParams)) != (self.connector.role == "prefill")):
            role = self.connector.role if self.connector is not None else "both"
            raise ValueError(f"this instance has role {role}: it cannot take a request with {type(kv).__name__}")
        req = self.make_request(request_id, prompt_token_ids, params)
        req.kv = kv
        if isinstance(kv, ImportParams):
            self.scheduler.add_remote(req)
            return req
        if kv is not None:
            self.connector.on_added(req)  # may refuse it (e.g. the destination's KV layout differs)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._wind_down_abandoned()
        if self.connector is not None:
            self.connector.forget(request_id)
            if req.kv_export is not None and req.is_finished:  # aborted before its push: nothing will write
                self._events.append(ExportFinished(request_id, None, "the request was aborted before its KV push"))
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def needs_step(self) -> bool:
        """A step would compute something, collect one in flight, take a peer's report, or watch a deadline."""
        return self.has_work() or self.executor.failed is not None or (self.connector is not None and (
            self.connector.has_events() or self.scheduler.has_remote() or bool(self.kv.quarantine)))

    def set_async_scheduling(self, enabled: bool | None) -> None:
        """Turn async scheduling on or off (None: on for CUDA devices), where the instance supports it (not on a
        prefill-role instance, whose steps hand each first token to a KV push). Takes effect from the next step."""
        want = self.device.type == "cuda" if enabled is None else enabled
        self.async_scheduling = want and async_supported(self.connector.role if self.connector is not None else None)
        self.runner.share_tokens = self.async_scheduling and self.executor.size > 1

    def take_events(self) -> list[PDEvent]:
        events, self._events = self._events, []
        return events

    def check_whole(self) -> None:
        """Raise unless no request holds a block and no step is in flight (tests)."""
        if self._inflight is not None or self.kv.retired:
            raise AssertionError("a step is still in flight (step until has_work() is False)")
        self.kv.pool.check_whole()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at size 1); idempotent."""
        self.executor.close()

    # ---- one step
    def step(self) -> list[CoreOutput]:
        """Schedule and launch a step; collect the step before it (async scheduling) or this one. Returns the
        outputs of the steps collected."""
        self.executor.check()  # a dead tensor-parallel rank fails the instance (WorkerDied is fatal)
        t0 = time.perf_counter()
        try:
            with nvtx_range(self.config.nvtx, f"engine.step {self.num_steps}"):
                return self._step()
        except BaseException:
            self._drop_in_flight()
            raise
        finally:
            self.totals["step_s"] += time.perf_counter() - t0

    def _step(self) -> list[CoreOutput]:
        outputs = self._take_kv_reports() if self.connector is not None else []
        if any(o.new_token_ids for o in outputs):
            return outputs  # first tokens a peer computed: out at once, not after the step in flight or the next one
        prev = self._inflight
        if prev is not None and not can_schedule_ahead(prev):
            outputs += self._collect(prev)  # this step needs what the previous one sampled: wait for it first
            self.async_counts["waited"] += 1
            prev = None
        batch = self.scheduler.schedule()
        self._wind_down_abandoned()
        outputs += failed_outputs(batch)
        launched = self._launch(batch) if batch else None
        if launched is not None and prev is not None:
            self.async_counts["overlapped"] += 1
        if prev is not None:
            outputs += self._collect(prev)
        if launched is not None and not self.async_scheduling:
            outputs += self._collect(launched)
        return outputs

    def _set_in_flight(self, step: InFlight | None) -> None:
        self._inflight = step
        self.scheduler.defer_frees = step is not None

    def _launch(self, batch) -> InFlight:
        hook = self.connector.layer_hook(batch) if self.connector is not None else None
        handle = self.executor.launch(batch, hook)
        if self.connector is not None:  # chunks before a prompt's last: their full blocks go out now
            for req, n in self.connector.push_ahead(batch):
                self.scheduler.pushed_ahead(req, n)
        self.num_steps += 1
        self.totals["prompt_tokens"] += sum(  # decode rows fail the test at once (10 us at 256 rows, 80 without it)
            min(r.num_computed_tokens + n, len(r.prompt_token_ids)) - r.num_computed_tokens
            for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens < len(r.prompt_token_ids))
        self.scheduler.launched(batch, handle.reqs)
        step = InFlight(handle, needs_history(handle.reqs))
        self._set_in_flight(step)
        return step

    def _collect(self, step: InFlight) -> list[CoreOutput]:
        t0 = time.perf_counter()
        result = self.executor.collect(step.handle)
        self.totals["collect_wait_s"] += time.perf_counter() - t0
        # blocks retired while this step was the newest in flight (requests that ended in the collect before it,
        # aborts) are free now: nothing launched after it touches them
        self.kv.release_retired()
        self._set_in_flight(None if self._inflight is step else self._inflight)
        new, exports = self.scheduler.collected(step.handle.reqs, result.token_ids if result else [],
                                                result.logprobs if result else [], time.time())
        self.totals["generation_tokens"] += sum(len(o.new_token_ids) for o in new)
        for ex in exports:
            mark(self.config.nvtx, f"pd.export {ex.req.request_id}")
            self.connector.start_export(ex)
            self.handover.exports += 1
        return new

    def _wind_down_abandoned(self) -> None:
        """Exports that ended before their push (aborted or preempted) while writes pushed ahead may still read their
        blocks: every rank reports when its writes ended, and `end_export` frees the blocks then."""
        for rid in self.scheduler.take_abandoned():
            self.connector.abandon_export(rid)

    def _drop_in_flight(self) -> None:
        """After a failed step: forget what was in flight (the engine loop ends the requests)."""
        self._set_in_flight(None)
        self.kv.release_retired()

    # ---- disaggregation: what the connector reports, applied through the scheduler
    def _take_kv_reports(self) -> list[CoreOutput]:
        c, s, now = self.connector, self.scheduler, time.time()
        outputs: list[CoreOutput] = []
        for a in c.take_arrivals():
            self.kv.release_quarantine(a.request_id)  # a push we gave up on did finish: its blocks are free now
            if a.error is not None:  # never decode on KV whose push failed
                outputs += self._remote_failed(a.request_id, f"the KV push failed: {a.error}", a.peer_done)
                continue
            req = s.admit_remote(a.request_id, a.first_token, now)
            if req is None:
                continue
            c.forget(a.request_id)
            skip_first_draw(req, self.hf_config.vocab_size, self.device)
            handover = now - a.t_prefill_done
            self.handover.imports += 1
            self.handover.handover_s.append(handover)
            mark(self.config.nvtx, f"pd.admitted {req.request_id} handover {handover * 1e3:.2f} ms")
            self._events.append(KVAdmitted(req.request_id, a.t_prefill_done, now, handover, a.t_push, a.t_notified))
            done = req.is_finished
            lp = [a.logprob] if (a.logprob is not None and req.params.logprobs is not None) else None
            outputs.append(CoreOutput(req.request_id, [a.first_token], done, req.finish_reason if done else None,
                                      req.stop_reason if done else None, lp, req.num_prompt_tokens,
                                      max(req.num_cached_tokens, 0), req.t_reserved))
        for r in c.take_finished_exports():
            req = s.end_export(r.request_id)
            if req is None:
                continue
            if r.error is not None:
                self.handover.export_failures += 1
            self._events.append(ExportFinished(r.request_id, req.output_token_ids[0] if r.error is None else None,
                                               r.error, req.first_token_time, r.push_s, r.nbytes, r.transport,
                                               req.first_scheduled_time, r.layerwise))
        for rid in s.expired_exports(now):
            c.cancel_export(rid)
        reserved, failed = s.reserve_remote(now)
        for req in reserved:
            self._events.append(c.reserved(req))
        outputs += [CoreOutput(r.request_id, [], True, "error", r.stop_reason, num_prompt_tokens=r.num_prompt_tokens)
                    for r in failed]
        for rid in s.expired_reservations(now):
            outputs += self._remote_failed(rid, "the KV handover did not complete within its lease", peer_done=False)
        self.kv.expire_quarantine(now)
        return outputs

    def _remote_failed(self, request_id: str, reason: str, peer_done: bool) -> list[CoreOutput]:
        recompute = self.config.kv_transfer.recompute_on_failure
        req = self.scheduler.fail_remote(request_id, recompute, peer_done, reason)
        if req is None:
            return []
        self.connector.forget(request_id)
        if recompute:
            self.handover.fallbacks += 1
            self._events.append(KVFallback(request_id, reason))
            return []
        return [CoreOutput(request_id, [], True, "error", reason, num_prompt_tokens=req.num_prompt_tokens)]

    def remote_prefill_failed(self, request_id: str, reason: str, peer_done: bool) -> list[CoreOutput]:
        """The server's order to prefill instances failed (message RemotePrefillFailed). With `peer_done`, blocks
        an earlier failure of this handover quarantined are free too (e.g. one rank's push failed while others
        still wrote; the prefill instance has answered since)."""
        if peer_done:
            self.kv.release_quarantine(request_id)
        return self._remote_failed(request_id, reason, peer_done)

    def remote_prefill_done(self, request_id: str) -> None:
        """The prefill peer answered for an aborted request: the blocks it was writing are free (RemotePrefillDone)."""
        self.kv.release_quarantine(request_id)

    def stats(self) -> dict:
        pool = self.kv.pool
        out = {
            **self.scheduler.stats(),
            "kv_usage": pool.usage(),
            "num_free_blocks": pool.num_free,
            "num_total_blocks": pool.num_blocks,
            "prefix_cache_queries": pool.queries,
            "prefix_cache_hits": pool.hits,
            "num_steps": self.num_steps,
            "async_steps_overlapped": self.async_counts["overlapped"],
            "prompt_tokens_total": self.totals["prompt_tokens"],
            "generation_tokens_total": self.totals["generation_tokens"],
            "step_s": self.totals["step_s"],
            "collect_wait_s": self.totals["collect_wait_s"],
        }
        if WATCH.armed:
            out.update(WATCH.stats())
        if PLANS.armed:
            out.update(PLANS.stats())
        if self.connector is not None:
            out["pd"] = {**self.handover.as_dict(), **self.connector.stats(),
                         "quarantine_blocks": self.kv.num_quarantined_blocks}
        return out

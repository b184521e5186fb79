"""The engine core: owns the model, the KV pool and the scheduler, and advances every request one step at a
time. Synchronous on purpose: it runs in its own process (or inline for offline use and tests)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.errors import PromptTooLong
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.runner import ModelRunner, block_bytes, kv_cache_torch_dtype
from pdserve.engine.scheduler import Scheduler
from pdserve.model.loader import build_model, choose_dtype, load_config, resolve_model
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class CoreOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None  # per new token: (chosen logprob, [(id, logprob), ...])
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    extra: dict | None = None  # disaggregation: e.g. handover timings


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


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None):
        self.config = config
        t0 = time.time()
        self.device = pick_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        source = resolve_model(config.model)
        self.hf_config, self.source = load_config(source)
        self.dtype = choose_dtype(config.dtype, self.device, self.hf_config)
        torch.manual_seed(config.seed)
        self.model = build_model(self.hf_config, self.source, self.device, self.dtype, config.load_format, config.seed)
        self.eos_token_ids = eos_ids_from_config(self.hf_config, eos_token_ids)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        bb = block_bytes(self.hf_config, config.block_size, kv_dtype)
        num_blocks = config.num_gpu_blocks or self._size_pool(bb)
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 8192))
        self.max_model_len = config.max_model_len or (model_max if self.device.type == "cuda" else min(model_max, 8192))
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit of {model_max} positions")
        self.block_bytes = bb
        self.runner = ModelRunner(self.model, self.hf_config, self.device, self.dtype, num_blocks, config.block_size,
                                  config.attention_backend, kv_dtype)
        if not config.enforce_eager:
            self.runner.capture_graphs(min(config.max_num_seqs, 512), self.max_model_len,
                                       config.max_num_batched_tokens)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.connector = None  # disaggregation hooks (pdserve.disagg), attached by the instance
        log.info("engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens (%.1f MiB each)",
                 time.time() - t0, config.model, self.device, self.dtype, num_blocks, config.block_size, bb / 2**20)

    def _size_pool(self, bb: int) -> int:
        if self.device.type == "cpu":
            return max(16, int(self.config.cpu_kv_cache_gb * 2**30) // bb)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        cfg = self.hf_config
        act = self.config.max_num_batched_tokens * (cfg.hidden_size * 12 + cfg.intermediate_size * 4) * 4
        act += self.config.max_num_seqs * cfg.vocab_size * 4 * 3
        budget = total * self.config.gpu_memory_utilization - used - act - (512 << 20)
        if budget < bb * 16:
            raise ValueError(f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after weights; "
                             f"raise --gpu-memory-utilization or use a smaller model")
        return int(budget // bb)

    # ---- requests
    def check_prompt(self, num_tokens: int, params: SamplingParams) -> None:
        if num_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_tokens >= self.max_model_len or (
            params.max_tokens is not None and num_tokens + params.max_tokens > self.max_model_len
        ):
            raise PromptTooLong(num_tokens, self.max_model_len, params.max_tokens)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not (0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:4]}")
        self.check_prompt(len(prompt_token_ids), params)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        req = self.make_request(request_id, prompt_token_ids, params)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if self.connector is not None and self.connector.on_abort(self, req):
            return True  # the connector owns blocks a peer may be reading or writing
        self.scheduler.finish(req, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def check_whole(self) -> None:
        """Raise unless no request holds a block (tests)."""
        self.kv.pool.check_whole()

    # ---- one step
    def step(self) -> list[CoreOutput]:
        outputs: list[CoreOutput] = []
        if self.connector is not None:
            outputs.extend(self.connector.before_step(self))
        batch = self.scheduler.schedule()
        for req in batch.preempted:
            if req.status == RequestStatus.FINISHED:  # could never fit
                self.requests.pop(req.request_id, None)
                outputs.append(CoreOutput(req.request_id, [], True, "error", req.stop_reason,
                                          num_prompt_tokens=req.num_prompt_tokens))
        if not batch:
            return outputs
        hook = self.connector.layer_hook(self, batch) if self.connector is not None else None
        sampled_reqs, result = self.runner.execute(batch, hook)
        self.num_steps += 1
        now = time.time()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        sampled = {id(r): i for i, r in enumerate(sampled_reqs)}
        for req in batch.requests:
            i = sampled.get(id(req))
            self.kv.cache_computed(req)
            if i is None:
                continue
            tok = result.token_ids[i]
            req.append_token(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            done = req.check_stop(self.max_model_len)
            lp = [result.logprobs[i]] if req.params.logprobs is not None else None
            out = CoreOutput(req.request_id, [tok], done, req.finish_reason if done else None,
                             req.stop_reason if done else None, lp, req.num_prompt_tokens,
                             max(req.num_cached_tokens, 0), req.first_scheduled_time)
            if self.connector is not None and req.kv_export is not None:
                self.connector.after_prefill(self, req, out)  # holds the blocks and pushes them; ends it later
                outputs.append(out)
                continue
            if done:
                self.requests.pop(req.request_id, None)
                if req.status != RequestStatus.FINISHED:
                    self.scheduler.finish(req)
            outputs.append(out)
        return outputs

    def stats(self) -> dict:
        s = self.scheduler
        pool = self.kv.pool
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_remote": len(s.remote),
            "running_tokens": sum(r.num_tokens for r in s.running),
            "waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
            "kv_usage": pool.usage(),
            "num_free_blocks": pool.num_free,
            "num_total_blocks": pool.num_blocks,
            "prefix_cache_queries": pool.queries,
            "prefix_cache_hits": pool.hits,
            "num_steps": self.num_steps,
            "num_preemptions": s.num_preemptions,
            **({"pd": self.connector.connector_stats(self)} if self.connector is not None else {}),
        }

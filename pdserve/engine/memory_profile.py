"""Sizing the KV pool from a measured step (CUDA): before the pool is made, every rank runs the largest step the
scheduler can plan on a small probe pool, and the memory that step needed above the model's weights is kept free.

The probe step is the worst case of one step: `max_num_batched_tokens` tokens (one long prompt, capped by the
model's length, beside one-token prompts) over `max_num_seqs` sequences, every one of them sampled with top-p,
top-k, penalties and logprobs (the sampler's largest temporaries: a sort of every sampled row's logits). Its peak
above what was allocated before it, or above what the allocator reserved before it where that is more (its rounding
and fragmentation: Worker.memory_peak), on the tightest rank, is the activation reserve. The probe pool is then freed,
and the pool gets what `gpu_memory_utilization` leaves after the weights, whatever else the step left allocated
outside PyTorch (cuBLAS workspaces, NCCL buffers: `mem_get_info` sees them), the measured peak and a margin for
the allocator's rounding. As in vLLM, the share is of what the engine allocates after it opened the device: the
CUDA context, and other processes' memory, were there before (pool_budget).

Where prefill rows may go through the library attention (pdserve.ops.attention.library_prefill: a chunk's prefix
gathered out of the pool, cuDNN's calls on padded inputs), a second probe measures that: one prompt of
max_model_len - 1 tokens alone, whose last chunk is a whole step's budget on the longest prefix such a chunk can
have. Until session 32 a bound of those transients (library_reserve: transient_bytes at the step's budget and
the model's length) was added to the first probe's peak whole, though they live during one layer's attention and
the first probe's peak is its MLP's (benchmarks/lease_s32, probe_memory.py); the bound stays where the second
probe cannot run.

An estimate from the model's shapes (what pdserve did before) has to cover every path and so reserved 4.2 GiB for
dummy Qwen3-8B at 8192 batched tokens, where vLLM, which profiles the same way, reserved 1.5 GiB in all: pdserve's
pool held 0.96x vLLM's KV tokens on the same H200 (benchmarks/lease_s5/tp_sbs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.engine.executor import Executor

log = logging.getLogger(__name__)

POOL_MARGIN_BYTES = 32 << 20  # left free beyond the measured peak: what the engine allocates after the probe (its
# runner's buffers) and the allocator's rounding beside the real pool. With none (as in vLLM), the largest step beside
# a pool sized at 0.6 of an H200 overran the share by 0.007 GiB, of which the step reserved 0.002 more than the probe
# had measured (test_memory_profile, benchmarks/lease_s32/s32c1); until session 32 the library attention's bound,
# added whole, had hidden it. On a crowded GPU AFTER_POOL_RESERVE_BYTES stays free
AFTER_POOL_RESERVE_BYTES = 1 << 30  # kept free on a crowded GPU for what comes after the pool: CUDA graphs (vLLM's
# took 1.00 GiB for Qwen3-8B on an H200, benchmarks/lease_s8/sbs/vllm.log.gz), cuBLAS workspaces of the capture


def probe_prompt_lens(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the probe step: as many tokens as one step takes over as many sequences as one step runs,
    each prompt short enough to be answered (at most max_model_len - 1)."""
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    longest = max(1, max_model_len - 1)
    lens = [1] * seqs
    rest = max_num_batched_tokens - seqs
    for i in range(seqs):  # the first prompts take the rest, each up to the longest a prompt may be
        if rest <= 0:
            break
        add = min(rest, longest - 1)
        lens[i] += add
        rest -= add
    return lens


def probe_params() -> SamplingParams:
    """The sampler's costliest path: every logits transform, a full sort for top-p, logprobs."""
    return SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.5,
                          frequency_penalty=0.5, repetition_penalty=1.1, logprobs=MAX_LOGPROBS, ignore_eos=True)


@dataclass(frozen=True)
class StepPeak:
    tokens: int  # scheduled in the probe step
    seqs: int
    peak_bytes: int  # the most any rank allocated during the step above what it held before it
    long_prefix: int = 0  # the long-prompt probe's last chunk: the prefix it read (0: that probe did not run)
    long_peak_bytes: int = 0  # that probe's peak (the library attention's gathered prefix and its calls)
    bound_bytes: int = 0  # library_reserve's bound added instead, where the long-prompt probe could not run


def probe_blocks(lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lens)


def long_prompt_chunks(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """The long-prompt probe's chunks: a prompt of max_model_len - 1 tokens (the longest one a request may have),
    whose first chunk takes the remainder so that its last one is a whole step's budget on the longest prefix a
    chunk of that size can have."""
    n = max(1, max_model_len - 1)
    full, rest = divmod(n, max_num_batched_tokens)
    return ([rest] if rest else []) + [max_num_batched_tokens] * full


def _run(executor: Executor, scheduler: Scheduler) -> tuple[object, int]:
    """Schedule and execute one step, waited for; (the batch, the most any rank's step took: Worker.memory_peak)."""
    batch = scheduler.schedule()
    executor.collective_rpc("mark_memory")
    reqs, result = executor.execute(batch)
    peak = max(executor.collective_rpc("memory_peak"))
    scheduler.update(batch, reqs, result.token_ids if result else [], result.logprobs if result else [],
                     time.time())
    return batch, peak


def measure_step_peak(executor: Executor, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                      block_size: int, attention_backend: str, kv_dtype: torch.dtype, vocab_size: int,
                      eos_token_ids: frozenset[int] = frozenset(), block_bytes: int = 0,
                      long_probe: bool | None = None) -> StepPeak:
    """Run the probe step on every rank over a probe pool, then free the pool and the runners again.

    Where a step's prefill rows may go through the library attention (library_reserve > 0 on a rank), or where
    `long_probe` says so, a second probe follows: one prompt of max_model_len - 1 tokens, alone, its chunks
    (long_prompt_chunks) each measured; its last chunk is a whole budget on the longest prefix, so the layer's
    gathered prefix and cuDNN calls are in what it measures. The peak is the larger of the two probes'. Where the
    GPU cannot hold that prompt's pool beside what the first probe took (`block_bytes` per rank), or its last chunk
    is too short for the library (MIN_FRESH alone, MIN_CHUNK on a prefix), library_reserve's bound is added to the
    first probe's peak instead."""
    lens = probe_prompt_lens(max_num_batched_tokens, max_num_seqs, max_model_len)
    num_blocks = probe_blocks(lens, block_size)
    params = probe_params()
    try:
        executor.init_runner(num_blocks, block_size, attention_backend, kv_dtype, probe=True)
        scheduler = Scheduler(KVCacheManager(num_blocks, block_size, enable_prefix_caching=False), len(lens),
                              max_num_batched_tokens, max_model_len)
        for i, n in enumerate(lens):  # distinct tokens: no prompt is another's prefix
            ids = [(i * 7919 + j) % vocab_size for j in range(n)]
            scheduler.add(Request(f"pdserve-probe-{i}", ids, params, eos_token_ids))
        batch, peak = _run(executor, scheduler)
        bound = 0
        if attention_backend in ("auto", "triton"):
            bound = max(executor.collective_rpc(library_reserve, max_num_batched_tokens, max_model_len, kv_dtype))
    finally:
        executor.release_runner()
    out = StepPeak(batch.total_tokens, len(batch.requests), peak)
    chunks = long_prompt_chunks(max_num_batched_tokens, max_model_len)
    if long_probe is None:
        long_probe = bound > 0
    long_blocks = -(-max_model_len // block_size)
    if long_probe and bound:
        from pdserve.ops.attention import library_prefill as lib

        room = min(free for free, *_ in executor.pool_memory()) - AFTER_POOL_RESERVE_BYTES - peak - bound
        takes_last = chunks[-1] >= (lib.MIN_FRESH if len(chunks) == 1 else lib.MIN_CHUNK)
        if not takes_last or long_blocks * block_bytes > room:
            long_probe = False  # the library would not take the last chunk, or its pool does not fit: the bound
    if long_probe:
        long_peak = 0
        try:
            executor.init_runner(long_blocks, block_size, attention_backend, kv_dtype, probe=True)
            scheduler = Scheduler(KVCacheManager(long_blocks, block_size, enable_prefix_caching=False), 1,
                                  max_num_batched_tokens, max_model_len)
            scheduler.add(Request("pdserve-probe-long", [(j * 7919 + 13) % vocab_size for j in range(sum(chunks))],
                                  params, eos_token_ids))
            prefix = 0
            for n in chunks:
                scheduler.max_num_batched_tokens = n  # the first chunk takes the remainder (long_prompt_chunks)
                batch, p = _run(executor, scheduler)
                if batch.num_new_tokens != [n]:
                    raise RuntimeError(f"the long-prompt KV sizing probe scheduled {batch.num_new_tokens}, not [{n}]")
                long_peak = max(long_peak, p)
                last_prefix, prefix = prefix, prefix + n
        finally:
            executor.release_runner()
        out = StepPeak(out.tokens, out.seqs, max(peak, long_peak), last_prefix, long_peak)
        log.info("KV sizing: a prompt of %d tokens alone, in chunks of %s, peaked at %.2f GiB above the weights "
                 "(its last chunk on a prefix of %d tokens)", sum(chunks), chunks, long_peak / 2**30, last_prefix)
    elif bound:
        out = StepPeak(out.tokens, out.seqs, peak + bound, bound_bytes=bound)
    log.info("KV sizing: the largest step (%d tokens, %d sequences, all sampled) peaked at %.2f GiB above the "
             "weights%s", out.tokens, out.seqs, peak / 2**30,
             f"; with the library attention's bound, {out.peak_bytes / 2**30:.2f} GiB" if out.bound_bytes else "")
    return out


def library_reserve(worker, max_tokens: int, max_model_len: int, kv_dtype: torch.dtype) -> int:
    """On a rank (Worker): what a step's prefill rows may hold in one layer's library attention
    (pdserve.ops.attention.library_prefill: a chunk's prefix gathered out of the pool, two partial outputs); 0
    where that path is off. An upper bound, added to the first probe's peak only where the long-prompt probe
    (which measures it) cannot run."""
    from pdserve.model.shapes import head_dim
    from pdserve.ops.attention import library_prefill as lib
    from pdserve.parallel.ranges import local_kv_heads

    cfg = worker.hf_config
    if not lib.takes_model(worker.device, worker.dtype, kv_dtype, head_dim(cfg)):
        return 0
    tp = worker.tp.size
    return lib.transient_bytes(max_tokens, max_model_len, max(1, cfg.num_attention_heads // tp),
                               local_kv_heads(cfg.num_key_value_heads, tp), head_dim(cfg), worker.dtype)


def pool_budget(total: int, free: int, utilization: float, peak_bytes: int, baseline_used: int = 0) -> int:
    """Bytes for the KV pool: the share of the GPU `utilization` grants, less what the engine holds now (weights,
    what the probe step left allocated, free blocks PyTorch's allocator keeps), the step's peak and the margin;
    never more than is free.

    `baseline_used`, what was in use on the device when the engine opened it (its CUDA context, other processes'
    memory; memory this process's PyTorch allocator held then, e.g. an earlier engine's, stays counted), is not the
    engine's: as in vLLM, whose budget is `utilization` x the device's memory less what the engine allocates after
    that point, so both report KV capacity for the same share of the same GPU. Where other processes leave less free
    than that share, the pool takes what is free less AFTER_POOL_RESERVE_BYTES.

    Unlike vLLM, free blocks the allocator keeps count as used: not counting them (0.61 GiB for dummy Qwen3-8B on an
    H200) left the largest step 0.11 GiB beyond even the share plus those blocks (benchmarks/lease_s13), where
    counting them keeps it within the share (test_memory_profile)."""
    engine_used = total - free - baseline_used
    return int(min(total * utilization - engine_used, free - AFTER_POOL_RESERVE_BYTES) - peak_bytes - POOL_MARGIN_BYTES)

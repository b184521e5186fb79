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

An estimate from the model's shapes (what pdserve did before) has to cover every path and so reserved 4.2 GiB for
dummy Qwen3-8B at 8192 batched tokens, where vLLM, which profiles the same way, reserved 1.5 GiB in all: pdserve's
pool held 0.96x vLLM's KV tokens on the same H200 (benchmarks/lease_s5/tp_sbs).
"""

from __future__ import annotations

import logging
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

POOL_MARGIN_BYTES = 0  # left free beyond the measured peak (allocated bytes, as vLLM's profile counts them): none,
# as in vLLM; at gpu_memory_utilization < 1 the rest of the GPU absorbs the caching allocator's rounding, and on a
# crowded GPU AFTER_POOL_RESERVE_BYTES stays free
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


def probe_blocks(lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lens)


def measure_step_peak(executor: Executor, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                      block_size: int, attention_backend: str, kv_dtype: torch.dtype, vocab_size: int,
                      eos_token_ids: frozenset[int] = frozenset()) -> StepPeak:
    """Run the probe step on every rank over a probe pool, then free the pool and the runners again."""
    lens = probe_prompt_lens(max_num_batched_tokens, max_num_seqs, max_model_len)
    num_blocks = probe_blocks(lens, block_size)
    try:
        executor.init_runner(num_blocks, block_size, attention_backend, kv_dtype, probe=True)
        scheduler = Scheduler(KVCacheManager(num_blocks, block_size, enable_prefix_caching=False), len(lens),
                              max_num_batched_tokens, max_model_len)
        params = probe_params()
        for i, n in enumerate(lens):  # distinct tokens: no prompt is another's prefix
            ids = [(i * 7919 + j) % vocab_size for j in range(n)]
            scheduler.add(Request(f"pdserve-probe-{i}", ids, params, eos_token_ids))
        batch = scheduler.schedule()
        executor.collective_rpc("mark_memory")
        executor.execute(batch)
        peak = max(executor.collective_rpc("memory_peak"))
        if attention_backend in ("auto", "triton"):
            peak += max(executor.collective_rpc(library_reserve, max_num_batched_tokens, max_model_len, kv_dtype))
    finally:
        executor.release_runner()
    out = StepPeak(batch.total_tokens, len(batch.requests), peak)
    log.info("KV sizing: the largest step (%d tokens, %d sequences, all sampled) peaked at %.2f GiB above the "
             "weights", out.tokens, out.seqs, peak / 2**30)
    return out


def library_reserve(worker, max_tokens: int, max_model_len: int, kv_dtype: torch.dtype) -> int:
    """On a rank (Worker): what a step's prefill rows may hold in one layer's library attention
    (pdserve.ops.attention.library_prefill: a chunk's prefix gathered out of the pool, two partial outputs), which
    the probe's fresh rows do not show; 0 where that path is off. Added to the measured peak whole, an upper bound:
    it is held during attention, while the peak the probe measured is mostly the MLP's."""
    from pdserve.model.shapes import head_dim
    from pdserve.ops.attention import library_prefill as lib
    from pdserve.parallel.ranges import local_kv_heads

    cfg = worker.hf_config
    if (kv_dtype != worker.dtype or worker.dtype not in lib.DTYPES or head_dim(cfg) > lib.MAX_HEAD_DIM
            or not lib.enabled(worker.device)):
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

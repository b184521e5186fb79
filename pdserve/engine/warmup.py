"""Start-up warm-up: a few real requests run through the engine before it serves, so the first users' requests do
not pay for compiling kernels.

Triton compiles a kernel the first time it meets a new specialization (another constexpr tile, an integer argument
that is 1 or a multiple of 16), and the fused MoE kernel takes another tile per token-count bucket. CUDA graph
capture compiles what decode batches and small mixed steps launch, but the prefill paths above it (long chunks,
chunked prefill reading a paged prefix, many sequences in one step) compiled inside the first requests served. That
is the likeliest reason why, on 2xH200 (TP=2, dummy Qwen3-8B, 1024/1024 at concurrency 256), the first run after
start-up had a mean TTFT of 3.3 s and the same run repeated on the same server 1.4 s (benchmarks/lease_s5/tp_sbs).

The requests, each group submitted at once and run to its end (`warmup_plan`):
  - one prompt per power-of-two length from one block up to `max_num_batched_tokens` (every MoE bucket, every
    single-sequence prefill tile);
  - a prompt longer than a step's token budget, chunked over steps that read its paged prefix, beside short
    prompts of odd lengths that finish their prefill first and decode in the long one's mixed steps, some of them
    sampled (temperature, top-p/top-k, penalties, logprobs) rather than greedy; four such groups, with 3, 7, 12
    and 40 short prompts (MIXED_ROWS: each count of rows takes another decode-kernel variant), and one more where the
    GPU's many-program tile is taken with several splits at fewer rows (decode.many_program_split_rows), and one
    with a row fewer than that (the few-row tile with several splits);
  - three short prompts alone (SHORT_ONLY), a 1-token one among them: a mixed step of few rows, all shorter than
    one decode split's least keys (one split); then nine (SHORT_MANY), the many-row tile with one split. Every other
    one of these sets no sampling option (temperature 1: the one-pass sampling kernel, pdserve.ops.sampling).

Then each rank builds the library prefill attention's call shapes for long rows (`warm_library`: cuDNN's plans,
pdserve.ops.attention.library_prefill). Afterwards the pool is whole, its blocks leave the prefix cache, and the counters a server reports are zero.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineCore

log = logging.getLogger(__name__)

SHORT_LENGTHS = (1, 7, 17, 33, 100, 257, 1000)  # odd lengths: none a multiple of 16 but 1, mixed with the long one
# Short prompts beside the long prompt's chunks, one group each. The decode kernel's variant in a mixed step follows
# the step's rows, the long one's included (decode.decode_tile, decode_splits): 3 shorts make 4 rows, the small-row
# tile with several splits (a prompt arriving while a few requests decode); 7 and 12 make 8 and 13, the many-row
# tile with several splits (rows x KV heads leave SMs idle); 40 make 41, one split. Each is its own Triton compile;
# on an H200 the mixed small-row variant was the one compile left in a 1024/1024 c256 run (benchmarks/lease_s8).
MIXED_ROWS = (3, len(SHORT_LENGTHS), 12, 40)
# A mixed step of few rows, none longer than decode.MIN_SPLIT_KEYS (the 1-token prompt is a decode row): the
# small-row tile with one split. With 100 tokens and 64 keys a split it took two, and a burst of short prompts then
# compiled the one-split mixed variant while serving (benchmarks/lease_s12/splits/gpu_tests_w4k64.txt).
SHORT_ONLY = (1, 7, 33)
# The same with 8 rows and more (the many-row tile, one split): a wave of short prompts, e.g. a model with few KV
# heads, where 41 rows beside a long prompt still take several splits.
SHORT_MANY = (1, 7, 33, 2, 9, 20, 3, 12, 40)
WARMUP_OUT_TOKENS = 4  # tokens each warm-up request decodes (the 1-step prompts of the size sweep: 2)
MAX_STEPS = 10_000  # a warm-up that has not ended after this many steps is a bug


@dataclass(frozen=True)
class WarmupRequest:
    prompt_len: int
    params: SamplingParams


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _plain(max_tokens: int) -> SamplingParams:
    """A request that sets no sampling option: temperature 1, which pdserve.ops.sampling's kernel samples."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _sampled(max_tokens: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=40, seed=i, ignore_eos=True,
                          presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1, logprobs=2)


def long_prompt_len(max_num_batched_tokens: int, max_model_len: int) -> int:
    """The chunked prompt's length: two steps' token budgets and an odd 17 more (its last chunk another size), within
    the model's length with the warm-up's output."""
    return min(2 * max_num_batched_tokens + 17, max_model_len - WARMUP_OUT_TOKENS)


def warmup_plan(max_num_batched_tokens: int, max_model_len: int, block_size: int,
                capacity_tokens: int, many_rows: int = 0, many_split_rows: int = 0) -> list[list[WarmupRequest]]:
    """Groups of requests, each group submitted at once; every prompt fits the model's length with its output, and
    every group fits the pool. `many_rows` (0: none): a mixed step of that many rows, from which the decode kernel
    takes its many-program tile (decode.many_program_rows); `many_split_rows` (0: none): mixed steps of that many
    rows beside the long prompt, where it takes that tile with several splits (decode.many_program_split_rows), and
    of one row fewer (the few-row tile with several splits)."""
    out_tokens = WARMUP_OUT_TOKENS
    longest = max_model_len - out_tokens
    groups: list[list[WarmupRequest]] = []
    n = block_size
    while n <= min(max_num_batched_tokens, longest):
        groups.append([WarmupRequest(n, _greedy(2))])
        n *= 2
    long_len = long_prompt_len(max_num_batched_tokens, max_model_len)
    if many_rows > 1:  # short prompts first (all prefilled in the first step), then the long one, chunked beside them
        group = [WarmupRequest(min(SHORT_MANY[i % len(SHORT_MANY)], longest), _greedy(out_tokens))
                 for i in range(many_rows - 1)]
        groups.append(group + [WarmupRequest(long_len, _greedy(out_tokens))])
    shorts = [x for x in SHORT_LENGTHS if x <= longest]
    # beside the long prompt: many_split_rows rows (the many-program tile with several splits), and one row fewer
    # (the few-row tile with several splits), which MIXED_ROWS' 3 shorts no longer give once 4 rows take the
    # many-program tile (an fp8 pool of 4 KV heads: lease_s36's MoE server compiled it at its first two requests)
    wanted = (many_split_rows - 1, many_split_rows - 2) if many_split_rows > 1 else ()
    extra = tuple(n for n in wanted if n >= 1 and n not in MIXED_ROWS)
    for rows in MIXED_ROWS + extra:
        mixed = [WarmupRequest(long_len, _greedy(out_tokens))]
        for i in range(rows if shorts else 0):
            n = shorts[i % len(shorts)]
            mixed.append(WarmupRequest(n, _sampled(out_tokens, i) if i % 2 else _greedy(out_tokens)))
        groups.append(mixed)
    for short in (SHORT_ONLY, SHORT_MANY):  # every other one at the default temperature (the one-pass sampler)
        groups.append([WarmupRequest(n, _plain(out_tokens) if i % 2 else _greedy(out_tokens))
                       for i, n in enumerate(x for x in short if x <= longest)])

    def blocks(r: WarmupRequest) -> int:
        return -(-(r.prompt_len + r.params.max_tokens) // block_size)

    budget = capacity_tokens // block_size
    fitted = []
    for g in groups:
        g = [r for r in g if blocks(r) <= budget]
        while g and sum(blocks(r) for r in g) > budget:
            g = g[:-1]
        if g:
            fitted.append(g)
    return fitted


def warm_up(core: EngineCore) -> dict:
    """Run the warm-up requests through `core`; returns what ran (requests, steps, seconds)."""
    cfg = core.config
    many, many_split = many_program_steps(core)
    plan = warmup_plan(cfg.max_num_batched_tokens, core.max_model_len, cfg.block_size,
                       core.kv.pool.num_blocks * cfg.block_size, many if many <= cfg.max_num_seqs else 0,
                       many_split if many_split <= cfg.max_num_seqs else 0)
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = int(core.hf_config.vocab_size)
    t0, steps, count = time.time(), 0, 0
    for g, group in enumerate(plan):
        for i, r in enumerate(group):
            ids = torch.randint(0, vocab, (r.prompt_len,), generator=gen).tolist()
            core.add_request(f"pdserve-warmup-{g}-{i}", ids, r.params)
            count += 1
        while core.has_work():
            core.step()
            steps += 1
            if steps > MAX_STEPS:
                raise RuntimeError(f"the start-up warm-up did not end after {MAX_STEPS} steps")
    core.check_whole()
    if cfg.attention_backend in ("auto", "triton"):
        count_lib = max(core.executor.collective_rpc(warm_library, cfg.max_num_batched_tokens, core.max_model_len,
                                                         cfg.max_long_prefill_tokens))
    else:
        count_lib = 0
    core.kv.pool.reset_prefix_cache()
    core.kv.pool.hits = core.kv.pool.queries = 0
    core.scheduler.num_preemptions = 0
    core.num_steps = 0
    core.async_counts = {"overlapped": 0, "waited": 0}
    done = {"requests": count, "steps": steps, "library_rows": count_lib, "seconds": round(time.time() - t0, 2)}
    log.info("warm-up: %d requests in %d steps, %d library attention shapes, %.1fs", done["requests"],
             done["steps"], count_lib, done["seconds"])
    return done


def many_program_steps(core: EngineCore) -> tuple[int, int]:
    """Rows of a step from which the Triton decode kernel takes its many-program tile on this engine's GPU, for one
    rank's KV heads, and the fewest rows beside the warm-up's long prompt that take it with several splits; (0, 0)
    where no such tile is used (other backends, an fp8 pool without MANY_PROGRAMS_TILE_FP8, CPU)."""
    from pdserve.engine.runner import kv_cache_torch_dtype
    from pdserve.ops.attention import decode
    from pdserve.ops.attention.common import is_fp8
    from pdserve.parallel.ranges import local_kv_heads

    kv_dtype = kv_cache_torch_dtype(core.config.kv_cache_dtype, core.dtype)
    fp8 = is_fp8(kv_dtype)
    if (core.device.type != "cuda" or core.config.attention_backend not in ("auto", "triton")
            or decode.many_tile(fp8) is None or not (fp8 or kv_dtype in (torch.bfloat16, torch.float16))):
        return 0, 0
    hk = local_kv_heads(core.hf_config.num_key_value_heads, core.config.tensor_parallel_size)
    long_len = long_prompt_len(core.config.max_num_batched_tokens, core.max_model_len)
    return (decode.many_program_rows(hk, core.device),
            decode.many_program_split_rows(hk, long_len, core.device, fp8))


def warm_library(worker, max_tokens: int, max_model_len: int, chunk: int = 0) -> int:
    """On a rank (Worker): build the library prefill's call shapes for this rank's heads, for full chunks and for
    chunks of `chunk` tokens (max_long_prefill_tokens) (pdserve.ops.attention.library_prefill.warm_up); cuDNN builds
    a plan the first time it meets a shape, 50-180 ms each on an H200, which the first long prompts would otherwise
    pay in their TTFT."""
    from pdserve.model.shapes import head_dim
    from pdserve.ops.attention import library_prefill
    from pdserve.parallel.ranges import local_kv_heads

    runner, cfg, tp = worker.runner, worker.hf_config, worker.tp.size
    if runner is None or not library_prefill.takes_model(worker.device, worker.dtype, runner.kv_dtype, head_dim(cfg)):
        return 0
    return library_prefill.warm_up(worker.device, worker.dtype, max(1, cfg.num_attention_heads // tp),
                                   local_kv_heads(cfg.num_key_value_heads, tp), head_dim(cfg), max_tokens,
                                   max_model_len, chunk)

"""KV sizing from a measured step (pdserve/engine/memory_profile.py), on CPU: the probe step is the largest one the
scheduler can plan (every token of the budget, every sequence slot, all sampled), it runs on every rank and leaves
no runner or pool behind, and the executor serves as before afterwards. The peak itself is a CUDA statistic
(0 on CPU); the budget arithmetic is checked on its own."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.executor import Executor
from pdserve.engine.memory_profile import (
    AFTER_POOL_RESERVE_BYTES,
    POOL_MARGIN_BYTES,
    long_prompt_chunks,
    measure_step_peak,
    pool_budget,
    probe_blocks,
    probe_prompt_lens,
)
from pdserve.engine.runner import kv_cache_torch_dtype
from pdserve.model.loader import load_config, resolve_model
from pdserve.ops.attention import library_prefill as lib
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("tokens,seqs,max_len", [(8192, 256, 40960), (8192, 256, 1000), (96, 8, 40), (64, 256, 512),
                                                 (10, 4, 2)])
def test_probe_prompts_fill_a_step(tokens, seqs, max_len):
    lens = probe_prompt_lens(tokens, seqs, max_len)
    assert len(lens) == min(seqs, tokens)  # every sequence slot a step has
    assert all(1 <= n <= max(1, max_len - 1) for n in lens)  # each prompt can be answered
    # every token of the budget, unless the model's length caps what that many sequences can hold
    assert sum(lens) == min(tokens, len(lens) * max(1, max_len - 1))


def test_budget_leaves_the_peak_and_the_margin():
    gib = 2**30
    assert pool_budget(total=100 * gib, free=80 * gib, utilization=0.9, peak_bytes=3 * gib) == \
        int(90 * gib - 20 * gib - 3 * gib - POOL_MARGIN_BYTES)


def test_budget_does_not_count_what_was_in_use_before_the_engine_but_never_takes_more_than_is_free():
    gib = 2**30
    # 1 GiB (CUDA context) was in use when the engine opened the GPU; it holds 19 GiB more now (as vLLM counts)
    assert pool_budget(total=100 * gib, free=80 * gib, utilization=0.9, peak_bytes=3 * gib, baseline_used=gib) == \
        int(90 * gib - 19 * gib - 3 * gib - POOL_MARGIN_BYTES)
    # another process held 50 GiB: a 0.9 share of the GPU is not free, so the pool gets what is free, less the
    # reserve for the CUDA graphs captured after it
    assert pool_budget(total=100 * gib, free=30 * gib, utilization=0.9, peak_bytes=3 * gib,
                       baseline_used=50 * gib) == int(30 * gib - AFTER_POOL_RESERVE_BYTES - 3 * gib - POOL_MARGIN_BYTES)


def _executor(path, tp: int) -> tuple[Executor, object, EngineConfig]:
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64,
                       max_num_batched_tokens=48, max_num_seqs=6, max_model_len=32, tensor_parallel_size=tp)
    hf, source = load_config(resolve_model(str(path)))
    return Executor(cfg, hf, source, torch.device("cpu"), torch.float32), hf, cfg


def _no_runner(worker) -> bool:
    return worker.runner is None


def _pool_blocks(worker) -> int:
    return worker.runner.kv_cache.shape[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_probe_step_runs_on_every_rank_and_leaves_nothing(tiny_model_dirs, tp):
    ex, hf, cfg = _executor(tiny_model_dirs["qwen3"], tp)
    try:
        seen: dict = {}
        execute = ex.execute

        def recording(batch, after_layer=None):
            seen["pool"] = weakref.ref(ex.runner.kv_cache)
            seen["blocks"] = ex.runner.kv_cache.shape[0] - 1  # less the scratch block
            reqs, result = execute(batch, after_layer)
            seen["sampled"] = len(reqs)
            seen["tokens"] = len(result.token_ids)
            seen["logprobs"] = sum(lp is not None for lp in result.logprobs)
            return reqs, result

        ex.execute = recording
        peak = measure_step_peak(ex, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                                 cfg.block_size, "auto", kv_cache_torch_dtype("auto", torch.float32),
                                 hf.vocab_size)
        ex.execute = execute
        lens = probe_prompt_lens(48, 6, 32)
        assert (peak.tokens, peak.seqs) == (sum(lens), len(lens)) == (48, 6)
        assert peak.peak_bytes == 0  # a CUDA statistic
        assert seen["sampled"] == seen["tokens"] == seen["logprobs"] == 6  # all sampled, with logprobs
        assert seen["blocks"] == probe_blocks(lens, cfg.block_size)
        gc.collect()
        assert seen["pool"]() is None  # the probe pool is gone
        assert ex.runner is None and ex.collective_rpc(_no_runner) == [True] * tp

        # the executor serves as before: a real pool, a request run to its end
        ex.init_runner(64, cfg.block_size, "auto", torch.float32)
        assert ex.collective_rpc(_pool_blocks) == [65] * tp
    finally:
        ex.close()


@pytest.mark.parametrize("budget,max_len", [(8192, 40960), (8192, 8193), (8192, 16385), (8192, 4096), (16, 60),
                                            (4, 2)])
def test_long_prompt_chunks_end_with_a_whole_budget_on_the_longest_prefix(budget, max_len):
    chunks = long_prompt_chunks(budget, max_len)
    assert sum(chunks) == max(1, max_len - 1)  # the longest prompt a request may have
    assert all(1 <= n <= budget for n in chunks)
    # the last chunk is a whole budget where the prompt has one, so its prefix is the longest such a chunk can have
    assert chunks[-1] == min(budget, max(1, max_len - 1))
    assert chunks[1:] == [budget] * (len(chunks) - 1)


def test_long_prompt_probe_runs_its_chunks_alone_and_leaves_nothing(tiny_model_dirs):
    """The second probe (CUDA: where the library attention may take prefill rows) on CPU, asked for: a prompt of
    max_model_len - 1 tokens alone, its first chunk the remainder and the rest whole budgets, on a pool that holds
    it; then no runner or pool is left."""
    ex, hf, cfg = _executor(tiny_model_dirs["qwen3"], 1)
    try:
        steps: list[tuple[list[int], list[int], int]] = []
        execute = ex.execute

        def recording(batch, after_layer=None):
            steps.append((list(batch.num_new_tokens), [r.num_computed_tokens for r in batch.requests],
                          ex.runner.kv_cache.shape[0] - 1))
            return execute(batch, after_layer)

        ex.execute = recording
        peak = measure_step_peak(ex, 16, 6, 60, 4, "auto", torch.float32, hf.vocab_size, long_probe=True)
        ex.execute = execute
        long = steps[1:]  # after the first probe's one step
        assert [s[0] for s in long] == [[n] for n in long_prompt_chunks(16, 60)] == [[11], [16], [16], [16]]
        assert [s[1] for s in long] == [[0], [11], [27], [43]]  # one request, each chunk on what came before
        assert peak.long_prefix == 43 and peak.long_peak_bytes == 0 == peak.bound_bytes  # CUDA statistics
        assert {s[2] for s in long} == {15}  # a pool for the whole prompt (60 tokens of 4-token blocks)
        assert ex.runner is None and ex.collective_rpc(_no_runner) == [True]
    finally:
        ex.close()


@pytest.mark.parametrize("case", ["fits", "no room", "short chunk"])
def test_long_prompt_probe_or_the_bound(tiny_model_dirs, monkeypatch, case):
    """Where a rank says the library attention may take prefill rows (library_reserve > 0), the second probe runs if
    its pool fits beside the first probe's peak and the bound, and the library would take its last chunk; else the
    bound is added to the first probe's peak, as before the second probe existed."""
    import pdserve.engine.memory_profile as mp

    ex, hf, cfg = _executor(tiny_model_dirs["qwen3"], 1)
    try:
        monkeypatch.setattr(mp, "library_reserve", lambda worker, *a: 12345)
        monkeypatch.setattr(lib, "MIN_CHUNK", 16 if case != "short chunk" else 17)  # the last chunk is 16 tokens
        free = 1 << 40 if case != "no room" else mp.AFTER_POOL_RESERVE_BYTES + 12345 + 15 * 1000 - 1
        monkeypatch.setattr(ex, "pool_memory", lambda: [(free, 1 << 40, 0, 0, 0)])
        peak = measure_step_peak(ex, 16, 6, 60, 4, "auto", torch.float32, hf.vocab_size, block_bytes=1000)
        if case == "fits":  # 15 blocks of 1000 bytes fit: measured (0 on CPU), no bound
            assert (peak.long_prefix, peak.bound_bytes, peak.peak_bytes) == (43, 0, 0)
        else:
            assert (peak.long_prefix, peak.bound_bytes, peak.peak_bytes) == (0, 12345, 12345)
        assert ex.runner is None
    finally:
        ex.close()


def test_engine_after_a_probe_answers_as_before(tiny_model_dirs, monkeypatch):
    """An engine whose executor ran the probe step before its pool was made gives the same greedy tokens as one
    whose executor did not (the probe's pool and KV leave no trace)."""
    real_init = Executor.__init__

    def answer(probe: bool) -> list[int]:
        def init(self, config, hf_config, *a, **k):
            real_init(self, config, hf_config, *a, **k)
            if probe:
                measure_step_peak(self, 48, 6, 64, 4, "auto", torch.float32, hf_config.vocab_size)

        monkeypatch.setattr(Executor, "__init__", init)
        core = EngineCore(EngineConfig(model=str(tiny_model_dirs["llama"]), device="cpu", dtype="float32",
                                       block_size=4, num_gpu_blocks=64, max_num_batched_tokens=48, max_num_seqs=6,
                                       max_model_len=64))
        try:
            core.add_request("a", [5, 3, 9, 2, 7, 1, 8], SamplingParams(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
            out: list[int] = []
            while core.has_work():
                for o in core.step():
                    out += o.new_token_ids
            core.check_whole()
            return out
        finally:
            core.close()

    assert answer(True) == answer(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("util,kv", [(0.3, "auto"), (0.6, "auto"), (0.3, "fp8")])
def test_the_largest_step_fits_beside_the_sized_pool(util, kv):
    """On CUDA: the pool sized from the measured steps leaves room for them. After the engine is made, the probe's
    step (every token of the budget, every sequence sampled) runs on the full pool, then a prompt of the model's
    length alone (the second probe's, whose last chunk reads the longest prefix through the library attention), and
    the GPU's memory in use (caching allocator included), less what was in use when the engine opened the GPU,
    stays within gpu_memory_utilization of it after each step; with a model-dtype pool and an fp8 one (whose long
    rows the library takes too, the prefix dequantized as it is gathered)."""
    used, allowed, blocks, parts = _largest_step_within(util, kv)
    assert blocks > 0 and used <= allowed, (f"{used / 2**30:.2f} GiB in use, {allowed / 2**30:.2f} GiB allowed; "
                                            + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in parts.items()))


def _largest_step_within(util: float, kv: str = "auto") -> tuple[int, int, int]:
    core = EngineCore(EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
                                   kv_cache_dtype=kv, gpu_memory_utilization=util, max_num_batched_tokens=4096, max_num_seqs=128,
                                   max_model_len=8192, enforce_eager=True, warmup=False))
    try:
        assert core.step_peak is not None and core.step_peak.peak_bytes > 0
        if lib.enabled(torch.device("cuda")):  # the second probe ran and measured, no bound was added
            assert core.step_peak.long_peak_bytes > 0 and core.step_peak.bound_bytes == 0
            assert core.step_peak.long_prefix == core.max_model_len - 1 - 4096
        lens = probe_prompt_lens(4096, 128, core.max_model_len)
        g = torch.Generator().manual_seed(0)
        for i, n in enumerate(lens):
            core.add_request(f"r{i}", torch.randint(0, 151000, (n,), generator=g).tolist(),
                             SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=50, logprobs=20,
                                            presence_penalty=0.5, repetition_penalty=1.1, ignore_eos=True))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        core.step()  # every prompt in one step: the probe's shape
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        baseline = core.executor.collective_rpc("memory_in_use")[0][2]  # in use before the engine: not its share
        reserved = torch.cuda.memory_reserved()
        parts = {"allocated": torch.cuda.memory_allocated(), "reserved": reserved,  # what the message reports
                 "outside PyTorch": total - free - baseline - reserved, "probe peak": core.step_peak.peak_bytes,
                 "in use before the engine": baseline, "allocated before the step": before[0],
                 "reserved before the step": before[1],
                 "the step's allocated peak": torch.cuda.max_memory_allocated() - before[0],
                 "the step's reserved peak": torch.cuda.max_memory_reserved() - before[1]}
        used = total - free - baseline
        while core.has_work():
            core.step()
        # the second probe's shape (where the library attention may take prefill rows): a prompt of the model's
        # length alone, chunk by chunk; what is in use after each step (the allocator keeps what it reserved)
        core.add_request("long", torch.randint(0, 151000, (core.max_model_len - 1,), generator=g).tolist(),
                         SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=50, logprobs=20,
                                        ignore_eos=True))
        while core.has_work():
            core.step()
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            used = max(used, total - free - baseline)
        parts["the long prompt's steps: most in use"] = used
        parts["long probe peak"] = core.step_peak.long_peak_bytes
        core.check_whole()
        return used, int(total * util), core.kv.pool.num_blocks, parts
    finally:
        core.close()

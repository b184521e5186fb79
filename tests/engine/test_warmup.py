"""The start-up warm-up (pdserve/engine/warmup.py) on CPU: the plan covers every power-of-two step size up to the
token budget and a chunked prompt beside short odd ones, within the pool and the model length; a warmed engine
ends whole, with nothing left in its prefix cache and zero counters, and then answers exactly as an unwarmed one."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.warmup import MIXED_ROWS, SHORT_LENGTHS, SHORT_MANY, SHORT_ONLY, warmup_plan
from pdserve.ops.attention.decode import MIN_SPLIT_KEYS
from pdserve.sampling_params import SamplingParams


def test_plan_covers_step_sizes_and_a_chunked_prompt():
    plan = warmup_plan(max_num_batched_tokens=8192, max_model_len=40960, block_size=16, capacity_tokens=10**6)
    singles = [g[0].prompt_len for g in plan if len(g) == 1]
    assert singles == [16 * 2**i for i in range(10)]  # 16 .. 8192
    groups = plan[-len(MIXED_ROWS) - 2:-2]
    for rows, mixed in zip(MIXED_ROWS, groups):
        assert mixed[0].prompt_len == 2 * 8192 + 17  # three steps, the later two on a paged prefix
        assert len(mixed) == 1 + rows and {r.prompt_len for r in mixed[1:]} <= set(SHORT_LENGTHS)
        assert any(r.params.temperature > 0 and r.params.logprobs for r in mixed)  # sampled, not only greedy
    assert [r.prompt_len for r in groups[1][1:]] == list(SHORT_LENGTHS)
    step_rows = sorted(1 + r for r in MIXED_ROWS)  # the long prompt is a row of each of its steps
    assert step_rows[0] < 8 <= step_rows[1] < step_rows[2] <= 16 < step_rows[3]  # both tiles, split and not
    # short prompts alone, a 1-token one a decode row among them: one split, with few rows and with many
    assert [r.prompt_len for r in plan[-2]] == list(SHORT_ONLY) and [r.prompt_len for r in plan[-1]] == list(SHORT_MANY)
    assert 1 in SHORT_ONLY and len(SHORT_ONLY) < 8 and max(SHORT_ONLY) <= MIN_SPLIT_KEYS
    assert 1 in SHORT_MANY and len(SHORT_MANY) >= 8 and max(SHORT_MANY) <= MIN_SPLIT_KEYS
    for g in plan[-2:]:  # greedy rows beside rows at the default temperature: the one-pass sampling kernel
        assert {r.params.temperature for r in g} == {0.0, 1.0}


def _plan_8k(**extra):
    """A plan for an 8k token budget and a 40k model with `extra` arguments, beside the plan without them."""
    return (warmup_plan(max_num_batched_tokens=8192, max_model_len=40960, block_size=16, capacity_tokens=10**6),
            warmup_plan(max_num_batched_tokens=8192, max_model_len=40960, block_size=16, capacity_tokens=10**6,
                        **extra))


def test_plan_has_a_mixed_step_of_the_many_program_rows_when_asked():
    plain, plan = _plan_8k(many_rows=66)
    extra = [g for g in plan if g not in plain]
    assert len(plan) == len(plain) + 1 and len(extra) == 1
    group = extra[0]
    # 65 short prompts, all prefilled in the first step, then the long one chunked beside them decoding: 66 rows
    assert len(group) == 66 and group[-1].prompt_len == 2 * 8192 + 17
    assert sum(r.prompt_len for r in group[:-1]) < 8192 and max(r.prompt_len for r in group[:-1]) <= MIN_SPLIT_KEYS
    assert plan[-len(MIXED_ROWS) - 2:] == plain[-len(MIXED_ROWS) - 2:]


def test_plan_has_a_mixed_step_of_the_many_split_rows_when_asked():
    """many_split_rows rows: the long prompt and that many minus one shorts decoding beside its chunks."""
    plain, plan = _plan_8k(many_split_rows=2)
    extra = [g for g in plan if g not in plain]
    assert len(plan) == len(plain) + 1 and len(extra) == 1
    assert [r.prompt_len for r in extra[0]] == [2 * 8192 + 17, 1]
    _, same = _plan_8k(many_split_rows=MIXED_ROWS[0] + 1)  # a row count the plan has already: only a row fewer
    assert [len(g) for g in same if g not in plain] == [MIXED_ROWS[0]]


def test_plan_has_a_mixed_step_of_a_row_fewer_than_the_many_split_rows():
    """An fp8 pool of 4 KV heads on an H200 takes the many-program tile with splits from 3 rows, so MIXED_ROWS' 4-row
    step takes it too: a 2-row step (the long prompt and a 1-token one, a decode row) keeps the few-row tile with
    splits warm (lease_s36's MoE server compiled it at its first requests)."""
    plain, plan = _plan_8k(many_split_rows=3)
    extra = [g for g in plan if g not in plain]
    assert sorted(len(g) for g in extra) == [2, 3]
    assert [r.prompt_len for r in min(extra, key=len)] == [2 * 8192 + 17, 1]
    _, plan2 = _plan_8k(many_split_rows=2)  # one row fewer is the long prompt alone: no decode row, no group
    assert [len(g) for g in plan2 if g not in plain] == [2]


def test_warm_up_steps_take_the_rows_the_plan_means(tiny_model_dirs, monkeypatch):
    """The scheduler really runs the plan's mixed steps: the many-program group's shorts decode beside the long
    prompt's chunks (a step of many_rows rows), and the split groups' 1-token prompt is a decode row in the step of
    the long prompt's last chunk."""
    import json

    path = tiny_model_dirs["qwen3"]
    cfg = json.loads((path / "config.json").read_text())
    core = EngineCore(EngineConfig(model=str(path), block_size=16, device="cpu", dtype="float32",
                                   num_gpu_blocks=4096, max_num_batched_tokens=256, max_num_seqs=64,
                                   max_model_len=cfg["max_position_embeddings"], warmup=False))
    plan = warmup_plan(256, core.max_model_len, 16, 4096 * 16, many_rows=20, many_split_rows=3)
    steps = []
    real = core.scheduler.schedule

    def spy():
        batch = real()
        if batch:
            decodes = sum(r.num_computed_tokens + n >= r.num_prompt_tokens and n == 1
                          for r, n in zip(batch.requests, batch.num_new_tokens))
            steps.append((len(batch.requests), decodes, len(batch.requests) - decodes))
        return batch

    monkeypatch.setattr(core.scheduler, "schedule", spy)
    gen = __import__("torch").Generator().manual_seed(0)
    seen = {}
    for g, group in enumerate(plan):
        if len(group) not in (20, 2, 3) or group[-1].prompt_len < 256 and group[0].prompt_len < 256:
            continue
        steps.clear()
        for i, r in enumerate(group):
            core.add_request(f"w-{g}-{i}", __import__("torch").randint(0, 200, (r.prompt_len,), generator=gen).tolist(),
                             r.params)
        while core.has_work():
            core.step()
        seen[len(group)] = list(steps)
    # rows, decode rows, prefill rows: a mixed step of every row of the group
    assert any(rows == 20 and 0 < dec < rows for rows, dec, _ in seen[20])
    for n in (2, 3):
        assert any(rows == n and dec >= 1 and pre >= 1 for rows, dec, pre in seen[n]), seen[n]


@pytest.mark.parametrize("max_model_len,capacity", [(64, 10**6), (40960, 600), (40960, 40)])
def test_plan_fits_the_model_length_and_the_pool(max_model_len, capacity):
    plan = warmup_plan(max_num_batched_tokens=256, max_model_len=max_model_len, block_size=16,
                       capacity_tokens=capacity)
    assert plan
    for g in plan:
        assert all(r.prompt_len + r.params.max_tokens <= max_model_len for r in g)
        assert sum(-(-(r.prompt_len + r.params.max_tokens) // 16) for r in g) <= capacity // 16


def _core(path, warmup: bool) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), block_size=4, device="cpu", dtype="float32", num_gpu_blocks=96,
                                   max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128, warmup=warmup))


def _answers(core: EngineCore) -> dict[str, list[int]]:
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": list(range(10, 50)), "c": [7]}
    for rid, ids in prompts.items():
        core.add_request(rid, ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work():
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    core.check_whole()
    return got


def test_warmed_engine_is_whole_clean_and_answers_the_same(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    warm = _core(path, True)
    assert warm.warmup["requests"] == len(sum(warmup_plan(32, 128, 4, 96 * 4), []))
    assert warm.warmup["steps"] > warm.warmup["requests"] // len(SHORT_LENGTHS)
    warm.check_whole()
    assert warm.kv.pool.cached == {}  # the warm-up's blocks are no prefix anyone can hit
    stats = warm.stats()
    assert stats["num_steps"] == 0 and stats["prefix_cache_queries"] == 0 and stats["num_preemptions"] == 0
    assert _answers(warm) == _answers(_core(path, False))
    cold = _core(path, None)  # default on CPU: off
    assert cold.warmup is None


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model,kv_cache_dtype", [("qwen3-0.6b", "auto"), ("qwen3-30b-a3b", "fp8")])
def test_a_burst_after_the_warm_up_compiles_nothing(model, kv_cache_dtype):
    """On CUDA: after the warm-up, a first wave of prompts beside running requests (mixed steps of many decode rows
    and prefill chunks, then decoding), a prompt arriving beside a few decoding requests, a few short prompts and then
    a dozen run on kernels already compiled (pdserve.ops.jit_watch counts any other). Also the seeds' model on an
    fp8 pool (4 KV heads: its decode kernel takes the many-program tile from fewer rows, and a prompt beside one
    decoding request compiled while serving in lease_s36)."""
    import torch

    from pdserve.ops.jit_watch import WATCH

    if model != "qwen3-0.6b" and torch.cuda.get_device_properties(0).total_memory < 100 * 2**30:
        pytest.skip("dummy Qwen3-30B-A3B's bf16 weights take 57 GiB: a GPU of 100 GiB or more")
    core = EngineCore(EngineConfig(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                                   kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=0.5 if model == "qwen3-0.6b"
                                   else 0.6, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096))
    try:
        assert WATCH.armed
        before = WATCH.compiled_after_arm
        g = torch.Generator().manual_seed(0)
        for i in range(96):  # 1000-token prompts: two per step, the earlier ones decoding beside them (up to 80
            # decode rows: past decode.many_program_rows, 66 for Qwen3-0.6B's 8 KV heads on an H200)
            ids = torch.randint(0, 151000, (1000 + i % 3,), generator=g).tolist()
            temp = {"temperature": 0.0} if i % 2 else {}  # greedy, or the default temperature (sampled)
            core.add_request(f"burst-{i}", ids, SamplingParams(max_tokens=40, ignore_eos=True, **temp))
        while core.has_work():
            core.step()
        # a prompt arriving while a few requests decode (mixed steps of few rows), then short prompts only
        for i in range(3):
            core.add_request(f"few-{i}", [5 + i] * 300, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            core.step()
        core.add_request("arrives", list(range(1, 1200)), SamplingParams(max_tokens=4, temperature=0.0))
        while core.has_work():
            core.step()
        for n in (1, 2, 5, 10):  # a prompt arriving beside n requests decoding at ~800 keys: with 5 and 10 on an
            # H200, rows x KV heads x splits reach the many-program tile with several splits (lease_s18 compiled it)
            for i in range(n):
                core.add_request(f"beside-{n}-{i}", [7 + i] * 800,
                                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for _ in range(3):
                core.step()
            core.add_request(f"arrives-{n}", list(range(1, 1200)), SamplingParams(max_tokens=4, temperature=0.0))
            while core.has_work():
                core.step()
        for wave in ((1, 9, 60), (1, 9, 60, 2, 30, 1, 17, 44, 5, 1, 3, 25)):  # few rows, then many: one split
            for i, n in enumerate(wave):
                core.add_request(f"short-{len(wave)}-{i}", [11] * n,
                                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            while core.has_work():
                core.step()
        core.check_whole()
        assert WATCH.compiled_after_arm == before, f"{WATCH.compiled_after_arm - before} kernels compiled in the burst"
    finally:
        core.close()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_step_one_token_past_an_mlp_part_compiles_nothing():
    """On CUDA: a step of MLP_CHUNK_TOKENS + 1 tokens (a prompt of that many beside one decoding request) runs its
    MLP without a one-row part (layers.mlp_parts), so after the warm-up it compiles no kernel. Qwen3-8B: on an H200
    its one-row gate_up product has a tile of its own (the shipped skinny table), which a one-row part compiled."""
    import torch

    from pdserve.model.layers import MLP_CHUNK_TOKENS
    from pdserve.ops.jit_watch import WATCH

    core = EngineCore(EngineConfig(model="qwen3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
                                   gpu_memory_utilization=0.5, max_num_batched_tokens=2 * MLP_CHUNK_TOKENS,
                                   max_num_seqs=8, max_model_len=2 * MLP_CHUNK_TOKENS + 64))
    try:
        before = WATCH.compiled_after_arm
        core.add_request("decoding", [3] * 20, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        core.step()
        g = torch.Generator().manual_seed(1)
        core.add_request("long", torch.randint(0, 151000, (MLP_CHUNK_TOKENS,), generator=g).tolist(),
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while core.has_work():  # the next step takes the decoding row and the whole prompt: 4096 + 1 tokens
            core.step()
        core.check_whole()
        assert WATCH.compiled_after_arm == before, f"{WATCH.compiled_after_arm - before} kernels compiled"
    finally:
        core.close()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv,strided", [("auto", False), ("fp8", False), ("auto", True)])
def test_long_prompts_after_the_warm_up_build_no_cudnn_plan(kv, strided, monkeypatch):
    """On CUDA (cuDNN's prefill: sm_90+): after the warm-up, a long prompt in --max-long-prefill-tokens' chunks beside
    a decoding request, one alone in full chunks, and one in full chunks beside a decoding request without the cap
    (shifted off the prefix buckets) run on cuDNN plans the warm-up built (plan_watch counts any other; their short
    last chunks go to the Triton kernel); a prefix-cache hit whose new tokens are a long chunk of a length no warm-up
    shape has then builds one, and the watcher counts it. With a model-dtype pool and an fp8 one, and with
    STRIDED_INPUTS (calls on views of the fused q/k/v, whose plans the warm-up builds on such views)."""
    import torch

    from pdserve.ops.attention import library_prefill as lib
    from pdserve.ops.attention.plan_watch import WATCH as PLANS
    from pdserve.ops.jit_watch import WATCH

    if not lib.enabled(torch.device("cuda")):
        pytest.skip("cuDNN's prefill needs compute capability 9.0+")
    monkeypatch.setattr(lib, "STRIDED_INPUTS", strided)
    core = EngineCore(EngineConfig(model="qwen3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
                                   gpu_memory_utilization=0.5, max_num_batched_tokens=8192, max_num_seqs=8,
                                   max_model_len=24576, max_long_prefill_tokens=2048, kv_cache_dtype=kv))
    try:
        assert PLANS.armed and core.warmup is not None
        compiled = WATCH.compiled_after_arm
        g = torch.Generator().manual_seed(2)
        long_ids = torch.randint(0, 151000, (20000,), generator=g).tolist()
        core.add_request("decoding", [3] * 20, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        core.step()
        core.add_request("capped", long_ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while core.has_work():  # 2048-token chunks on prefixes of 2048, 4096, ... beside the decoding row
            core.step()
        core.add_request("alone", torch.randint(0, 151000, (20000,), generator=g).tolist(),
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while core.has_work():  # 8192-token chunks on prefixes of 8192 and 16384
            core.step()
        core.scheduler.max_long_prefill_tokens = 0  # as an engine without the cap: full chunks beside decode rows
        core.add_request("decoding-2", [4] * 20, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        core.step()
        core.add_request("shifted", torch.randint(0, 151000, (20000,), generator=g).tolist(),
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while core.has_work():  # 8191-token chunks: the second on a prefix 1023 tokens past a bucket (shifted_chunks)
            core.step()
        assert PLANS.built_after_arm == 0, f"{PLANS.built_after_arm} cuDNN plans built ({PLANS.stats()})"
        # the first 8192 tokens from the prefix cache, then new ones past MIN_CHUNK, of a length no warm-up shape has
        # (nor the other pool's run: plans live as long as the process, and both runs call cuDNN in the model dtype)
        new = {("auto", False): 5000, ("fp8", False): 5600, ("auto", True): 6100}[kv, strided]
        core.add_request("hit", long_ids[:8192] + list(range(1, new + 1)), SamplingParams(max_tokens=2, temperature=0.0))
        while core.has_work():
            core.step()
        assert PLANS.built_after_arm >= 1 and PLANS.seconds_after_arm > 0
        assert core.stats()["cudnn_plans_built_after_warmup"] == PLANS.built_after_arm
        core.check_whole()
        assert WATCH.compiled_after_arm == compiled, f"{WATCH.compiled_after_arm - compiled} kernels compiled"
    finally:
        core.close()

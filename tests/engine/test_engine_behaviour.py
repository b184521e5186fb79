"""Engine behaviour without a reference model: block accounting under aborts and preemption, sampling
parameters, and the errors bad input gets."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.errors import PromptTooLong
from pdserve.sampling_params import InvalidParameter, SamplingParams


@pytest.fixture(scope="module")
def core_factory(tiny_model_dirs):
    def make(arch="llama", **kw):
        kw.setdefault("num_gpu_blocks", 64)
        kw.setdefault("block_size", 4)
        return EngineCore(EngineConfig(model=str(tiny_model_dirs[arch]), **kw))

    return make


def drain(core, max_steps=20_000):
    out = {}
    for _ in range(max_steps):
        if not core.has_work():
            return out
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("engine did not drain")


def test_pool_whole_after_random_aborts_and_preemptions(core_factory):
    core = core_factory("gemma3", num_gpu_blocks=30, max_num_batched_tokens=32, max_num_seqs=12)
    rng = random.Random(1)
    shared = [rng.randrange(3, 250) for _ in range(12)]
    live: set[str] = set()
    finished = 0
    aborted = 0
    for i in range(200):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.9]), seed=i,
                                ignore_eos=True)
        core.add_request(str(i), prompt, params)
        live.add(str(i))
        for _ in range(rng.randrange(0, 2) if i % 4 else 4):
            for o in core.step():
                if o.finished:
                    live.discard(o.request_id)
                    finished += 1
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            assert core.abort_request(victim)
            live.discard(victim)
            aborted += 1
    for o in [o for _ in range(20_000) if core.has_work() for o in core.step()]:
        if o.finished:
            live.discard(o.request_id)
            finished += 1
    assert not live, f"requests never finished: {sorted(live)[:5]}"
    assert finished + aborted == 200
    assert core.stats()["num_preemptions"] > 0
    assert core.stats()["prefix_cache_hits"] > 0
    core.kv.pool.check_whole()
    assert core.stats()["num_free_blocks"] == 30


def test_same_seed_same_text_and_different_seed_differs(core_factory):
    core = core_factory("qwen3")
    prompt = [5, 9, 13, 17]
    for rid, seed in (("a", 7), ("b", 7), ("c", 8)):
        core.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=1.5, seed=seed, ignore_eos=True))
    out = drain(core)
    assert out["a"] == out["b"]
    assert out["a"] != out["c"]


def test_top_k_one_is_greedy_and_top_k_bounds_support(core_factory, tiny_model_dirs):
    import torch

    from tests.engine.tiny_models import hf_model

    core = core_factory("llama")
    prompt = [3, 4, 5, 6]
    core.add_request("g", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    core.add_request("k1", prompt, SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True))
    for i in range(6):
        core.add_request(f"k3-{i}", prompt, SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=i))
        core.add_request(f"p-{i}", prompt, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.3, seed=i))
    out = drain(core)
    assert out["g"] == out["k1"]
    ref = hf_model(tiny_model_dirs["llama"])
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    assert all(out[f"k3-{i}"][0] in top3 for i in range(6))
    # the nucleus: the fewest most likely tokens whose mass reaches top_p
    probs, order = torch.softmax(logits, -1).sort(descending=True)
    n = int((probs.cumsum(-1) < 0.3).sum()) + 1
    nucleus = set(order[:n].tolist())
    assert n < 200
    assert all(out[f"p-{i}"][0] in nucleus for i in range(6))


def test_stop_token_ids_max_tokens_and_min_tokens(core_factory):
    core = core_factory("llama")
    prompt = [3, 4, 5, 6]
    core.add_request("free", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    free = drain(core)["free"]
    stop_tok = free[3]
    first = free.index(stop_tok)
    core.add_request("stop", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok],
                                                    ignore_eos=True))
    core.add_request("min", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok],
                                                   min_tokens=first + 2, ignore_eos=True))
    finals = {}
    while core.has_work():
        for o in core.step():
            finals.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id + ":reason"] = (o.finish_reason, o.stop_reason)
    assert finals["stop"] == free[: first + 1]
    assert finals["stop:reason"] == ("stop", stop_tok)
    assert len(finals["min"]) > first + 1 and stop_tok not in finals["min"][: first + 2]
    core.add_request("len", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(drain(core)["len"]) == 5


def test_eos_ends_unless_ignored(core_factory):
    core = core_factory("llama")
    prompt = [3, 4, 5, 6]
    core.add_request("free", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    free = drain(core)["free"]
    core.eos_token_ids = frozenset({free[2]})
    core.add_request("eos", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    assert drain(core)["eos"] == free[: free.index(free[2]) + 1]


def test_prompt_too_long_names_both_numbers(core_factory):
    core = core_factory("llama", max_model_len=32)
    with pytest.raises(PromptTooLong, match="maximum context length is 32 tokens.*40 tokens"):
        core.add_request("x", list(range(3, 43)), SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLong, match="30 in the prompt, 8 for the completion"):
        core.add_request("y", list(range(3, 33)), SamplingParams(max_tokens=8))


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_p=2), "min_p"), (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_parameters_name_the_parameter(kw, param):
    with pytest.raises(InvalidParameter, match=param) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_unknown_architecture_and_missing_files(tmp_path, tiny_model_dirs):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture.*FooForCausalLM"):
        EngineCore(EngineConfig(model=str(bad), num_gpu_blocks=8))
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((tiny_model_dirs["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        EngineCore(EngineConfig(model=str(noweights), num_gpu_blocks=8))
    with pytest.raises(FileNotFoundError, match="not found"):
        EngineCore(EngineConfig(model=str(tmp_path / "nowhere"), num_gpu_blocks=8))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        EngineCore(EngineConfig(model=str(tmp_path), num_gpu_blocks=8))


def test_dummy_load_of_a_shipped_shape_refuses_real_weights():
    from pdserve.model.loader import build_model, load_config, resolve_model

    src = resolve_model("qwen3-0.6b")
    cfg, src = load_config(src)
    assert cfg.num_hidden_layers == 28
    import torch

    with pytest.raises(ValueError, match="--load-format dummy"):
        build_model(cfg, src, torch.device("cpu"), torch.float32, "safetensors", 0)


def test_prompt_larger_than_the_pool_fails_that_request_only(core_factory):
    core = core_factory("llama", num_gpu_blocks=4, max_model_len=64)
    core.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=2))
    outs = [o for _ in range(10) for o in core.step()]
    assert outs and outs[0].finish_reason == "error" and "KV blocks" in str(outs[0].stop_reason)
    core.add_request("ok", [3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(drain(core)["ok"]) == 2
    core.kv.pool.check_whole()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_totals_for_the_stats_line_count_prompt_tokens_computed_and_tokens_sampled(core_factory, async_scheduling):
    """EngineCore.totals (the server's stats line): prompt tokens computed, in chunks too (prefix-cache hits are not
    computed), every token sampled, and a wait for sampled tokens at least once a step; with async scheduling too,
    where a finished request's extra step is dropped."""
    core = core_factory("qwen3", max_num_batched_tokens=8, async_scheduling=async_scheduling)
    prompt = list(range(3, 23))  # 20 tokens: chunks of 8, 8, 4 (block size 4)
    core.add_request("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    out = drain(core)
    s = core.stats()
    assert len(out["a"]) == 5
    assert (s["prompt_tokens_total"], s["generation_tokens_total"]) == (20, 5)
    assert s["num_steps"] >= 3 + 4 and s["collect_wait_s"] > 0
    core.add_request("b", prompt + [40, 41], SamplingParams(max_tokens=3, ignore_eos=True))
    out = drain(core)
    s2 = core.stats()
    hit = s2["prefix_cache_hits"] - s["prefix_cache_hits"]
    assert hit > 0 and len(out["b"]) == 3
    assert s2["prompt_tokens_total"] - s["prompt_tokens_total"] == 22 - hit  # the hit's tokens were not computed
    assert s2["generation_tokens_total"] - s["generation_tokens_total"] == 3
    assert s2["collect_wait_s"] >= s["collect_wait_s"]

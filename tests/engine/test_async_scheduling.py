"""Async scheduling (one step in flight) against the synchronous engine on CPU: what clients see — tokens, text
after stop strings, finish and stop reasons, logprobs — is identical, with staggered arrivals, different
max_tokens, EOS and stop-token stops, stop strings, n > 1 siblings, aborts mid-stream, preemption in a tiny pool,
chunked prefill and prefix-cache hits; the pool is whole at the end. Also: `launch` never syncs with the host, and
the steps that must wait (penalties) do."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.output_processor import RequestState
from pdserve.sampling_params import SamplingParams

VOCAB = 256


class CharTokenizer:
    """One letter per token id: enough text for stop strings."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def core_for(path, async_on: bool, eos: set[int] | None = None, **kw) -> EngineCore:
    kw.setdefault("num_gpu_blocks", 48)
    kw.setdefault("max_num_batched_tokens", 16)  # prompts longer than this are chunked
    kw.setdefault("max_num_seqs", 8)
    return EngineCore(EngineConfig(model=str(path), block_size=4, device="cpu", dtype="float32",
                                   async_scheduling=async_on, **kw), eos_token_ids=eos)


def drive(core: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          abort_after: dict[str, int] | None = None) -> dict[str, dict]:
    """Run to the end like a frontend: requests arrive before step k, outputs go through RequestState (stop strings
    end a request there and abort it in the core), a request in `abort_after` is aborted by the client once it
    has seen that many tokens. Returns what each client saw."""
    abort_after = abort_after or {}
    arrivals = {k: list(v) for k, v in arrivals.items()}
    states: dict[str, RequestState] = {}
    seen: dict[str, dict] = {}
    step = 0
    while arrivals or core.has_work():
        for rid, prompt, params in arrivals.pop(step, []):
            core.add_request(rid, prompt, params)
            states[rid] = RequestState(rid, prompt, params, CharTokenizer())
            seen[rid] = {"tokens": [], "text": "", "finish": None, "stop": None, "logprobs": []}
        for co in core.step():
            st = states.get(co.request_id)
            if st is None:  # ended by the client already: the core may still report it
                continue
            out = st.process(co)
            s = seen[co.request_id]
            s["tokens"] += out.new_token_ids
            s["text"] += out.new_text
            s["logprobs"] += [(lp.logprob, lp.top) for lp in out.logprobs or []]
            if out.finished:
                if not co.finished:
                    assert core.abort_request(co.request_id)
                s["finish"], s["stop"] = out.finish_reason, out.stop_reason
                del states[co.request_id]
            elif st.num_output_tokens >= abort_after.get(co.request_id, 1 << 30):
                assert core.abort_request(co.request_id)
                s["finish"] = "client-abort"
                del states[co.request_id]
        step += 1
        assert step < 5000, "the engine did not drain"
    assert not states, f"never finished: {sorted(states)}"
    core.check_whole()
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
    return seen


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def workload(rng: random.Random, sampled: bool, stops: dict[str, list[int]] | None = None,
             logprobs: bool = False, ignore_eos: bool = True) -> tuple[dict, dict]:
    """Staggered arrivals of mixed lengths (chunked prompts among them), siblings with one prompt (n > 1), a second
    wave that hits the prefix cache, and client aborts."""
    stops = stops or {}
    shared = _prompt(rng, 22)
    sib = _prompt(rng, 9)

    def params(rid: str, i: int, **kw) -> SamplingParams:
        if sampled:
            kw.update(temperature=0.8, seed=100 + i, top_k=[-1, 40][i % 2], top_p=[1.0, 0.9][i % 3 == 0],
                      min_p=[0.0, 0.05][i % 4 == 1])
        else:
            kw.update(temperature=0.0)
        if logprobs and i % 3 == 0:
            kw["logprobs"] = i % 4
        return SamplingParams(stop_token_ids=stops.get(rid, []), ignore_eos=ignore_eos, **kw)

    arrivals: dict[int, list] = {}
    specs = [  # rid, arrival step, prompt, max_tokens, extras
        ("long", 0, _prompt(rng, 41), 9, {}),
        ("short", 0, _prompt(rng, 2), 17, {}),
        ("a", 1, shared + _prompt(rng, 3), 12, {}),
        ("n0", 2, sib, 10, {}),
        ("n1", 2, sib, 10, {}),
        ("n2", 2, sib, 14, {}),
        ("b", 3, _prompt(rng, 13), 6, {"min_tokens": 3}),
        ("c", 4, _prompt(rng, 5), 1, {}),
        ("ab1", 5, _prompt(rng, 7), 30, {}),
        ("d", 7, _prompt(rng, 19), 11, {"logit_bias": {5: 3.0, 17: -2.0}}),
        ("e", 9, _prompt(rng, 3), 8, {"allowed_token_ids": list(range(20, 80))}),
        ("a2", 25, shared + _prompt(rng, 6), 10, {}),  # after "a" computed its prompt: prefix-cache hits
        ("ab2", 26, _prompt(rng, 11), 30, {}),
        ("f", 27, _prompt(rng, 4), 13, {}),
    ]
    for i, (rid, at, prompt, mt, extra) in enumerate(specs):
        arrivals.setdefault(at, []).append((rid, prompt, params(rid, i, max_tokens=mt, **extra)))
    return arrivals, {"ab1": 4, "ab2": 1}


def compare(path, arrivals, abort_after, eos=None, **kw) -> tuple[dict, EngineCore]:
    ref = drive(core_for(path, False, eos, **kw), arrivals, abort_after)
    core = core_for(path, True, eos, **kw)
    got = drive(core, arrivals, abort_after)
    assert got.keys() == ref.keys()
    for rid in ref:
        g, r = dict(got[rid]), dict(ref[rid])
        glp, rlp = g.pop("logprobs"), r.pop("logprobs")
        assert g == r, f"{rid}: async {g} != sync {r}"
        # the batches differ (a finished request's extra row, other arrivals per step), so float sums may round
        # differently in the last bits: logprobs agree closely, their top ids exactly
        assert len(glp) == len(rlp), rid
        for (gv, gtop), (rv, rtop) in zip(glp, rlp):
            assert gv == pytest.approx(rv, abs=1e-4), rid
            assert [t for t, _ in gtop] == [t for t, _ in rtop], rid
            assert [v for _, v in gtop] == pytest.approx([v for _, v in rtop], abs=1e-4), rid
    assert core.async_counts["overlapped"] > 0
    return ref, core


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_async_matches_sync(arch, sampled, tiny_model_dirs):
    path = tiny_model_dirs[arch]
    arrivals, aborts = workload(random.Random(1), sampled, logprobs=True)
    ref, core = compare(path, arrivals, aborts)
    assert all(ref[r]["finish"] == "length" for r in ("long", "short", "a", "n0", "c", "a2", "f"))
    assert ref["ab1"]["finish"] == "client-abort" and len(ref["ab1"]["tokens"]) == 4
    assert len(ref["c"]["tokens"]) == 1 and len(ref["n2"]["tokens"]) == 14
    assert any(ref[r]["logprobs"] for r in ref)
    assert all(20 <= t < 80 for t in ref["e"]["tokens"])
    stats = core.stats()
    assert stats["prefix_cache_hits"] >= 16, "the test meant to hit the prefix cache"
    if not sampled:
        assert ref["n0"]["tokens"] == ref["n1"]["tokens"]


def test_async_matches_sync_with_stops_and_preemption(tiny_model_dirs):
    """EOS (the run's most common token), stop ids and stop strings chosen from a probe run so that requests stop
    mid-stream; a pool too small for every sequence, so requests are preempted (some with a token in flight)."""
    path = tiny_model_dirs["llama"]
    arrivals, aborts = workload(random.Random(2), sampled=False)
    probe = drive(core_for(path, False), arrivals, aborts)
    common = Counter(t for s in probe.values() for t in s["tokens"]).most_common(1)[0][0]
    long_enough = sorted(rid for rid, s in probe.items() if len(s["tokens"]) > 4)
    stops = {rid: [probe[rid]["tokens"][len(probe[rid]["tokens"]) // 2]] for rid in long_enough[::2]}
    texts = {rid: probe[rid]["text"][2:4] for rid in long_enough[1::2]}  # one letter per token
    arrivals, aborts = workload(random.Random(2), sampled=False, stops=stops, ignore_eos=False)
    for batch in arrivals.values():
        for rid, _, p in batch:
            if rid in texts:
                p.stop = [texts[rid]]
    ref, core = compare(path, arrivals, aborts, eos={common}, num_gpu_blocks=20)
    reasons = Counter(s["finish"] for s in ref.values())
    assert reasons["stop"] >= 3, reasons
    assert any(isinstance(s["stop"], str) for s in ref.values()), "a stop string should have ended a request"
    assert any(s["stop"] is None and s["finish"] == "stop" for s in ref.values()), "EOS should have ended one"
    assert core.stats()["num_preemptions"] > 0, "the test meant to preempt"


def test_seeded_sampling_with_preemption_matches(tiny_model_dirs):
    path = tiny_model_dirs["gemma3"]
    arrivals, aborts = workload(random.Random(3), sampled=True)
    _, core = compare(path, arrivals, aborts, num_gpu_blocks=20)
    assert core.stats()["num_preemptions"] > 0


def test_penalties_wait_for_the_previous_step(tiny_model_dirs):
    """Penalties read the output history on the host: those steps are collected before the next is scheduled,
    and the tokens are still the synchronous engine's."""
    path = tiny_model_dirs["qwen3"]
    rng = random.Random(4)
    arrivals = {0: [("p", _prompt(rng, 6), SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3,
                                                          presence_penalty=0.5, frequency_penalty=0.4)),
                    ("q", _prompt(rng, 6), SamplingParams(max_tokens=20, temperature=0.0))]}
    _, core = compare(path, arrivals, {})
    assert core.async_counts["waited"] >= 10


def test_max_model_len_stop(tiny_model_dirs):
    """A request that runs into max_model_len: the extra token of the step after it is never emitted."""
    path = tiny_model_dirs["llama"]
    rng = random.Random(5)
    arrivals = {0: [("m", _prompt(rng, 20), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)),
                    ("s", _prompt(rng, 3), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]}
    ref, _ = compare(path, arrivals, {}, max_model_len=32)
    assert len(ref["m"]["tokens"]) == 12 and ref["m"]["finish"] == "length"


def test_abort_with_a_step_in_flight_drops_its_token(tiny_model_dirs):
    core = core_for(tiny_model_dirs["llama"], True)
    core.add_request("x", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    core.add_request("y", [8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    outs = core.step()
    assert outs == [] and core.has_work()  # the first step is in flight; nothing collected yet
    outs = core.step()
    assert {o.request_id for o in outs} == {"x", "y"}
    assert core.abort_request("x")  # x's next token is being computed
    held = len(core.kv.retired)
    assert held == 1, "x's blocks stay held while the step in flight may write them"
    rest = [o for _ in range(100) if core.has_work() for o in core.step()]
    assert all(o.request_id == "y" for o in rest)
    assert sum(len(o.new_token_ids) for o in rest) == 5 and rest[-1].finished
    core.check_whole()


def test_launch_does_not_sync_with_the_host(tiny_model_dirs, monkeypatch):
    """On CPU there is no device to wait for, so count what would wait on one: reading a tensor's values into
    Python (tolist, item, int/float/bool, numpy). None may happen inside `launch`; `collect` reads the tokens."""
    core = core_for(tiny_model_dirs["qwen3"], True)
    rng = random.Random(6)
    for i in range(4):  # greedy, seeded top-k/top-p/min-p, logprobs, logit_bias, allowed ids, min_tokens
        core.add_request(f"r{i}", _prompt(rng, 5 + 9 * i), SamplingParams(
            max_tokens=8, temperature=[0.0, 0.7][i % 2], seed=i, top_k=[-1, 30][i % 2], top_p=[1.0, 0.8][i > 1],
            min_p=0.02 * (i == 3), logprobs=[None, 2][i % 2], logit_bias={9: 1.0} if i == 2 else None,
            allowed_token_ids=list(range(10, 200)) if i == 3 else None, min_tokens=2))
    reads: list[str] = []
    phase = {"in": None}

    def counting(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            if phase["in"] is not None:
                reads.append(f"{phase['in']}:{name}")
            return orig(self, *a, **k)

        return wrapper

    for name in ("tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    runner = core.runner
    for name in ("launch", "collect"):
        orig = getattr(runner, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            phase["in"] = _name
            try:
                return _orig(*a, **k)
            finally:
                phase["in"] = None

        monkeypatch.setattr(runner, name, wrapped)
    while core.has_work():
        core.step()
    assert core.async_counts["overlapped"] > 5
    assert not [r for r in reads if r.startswith("launch:")], sorted(set(reads))
    assert "collect:tolist" in reads
    core.check_whole()


def test_async_default_is_off_on_cpu_and_flag_wins(tiny_model_dirs):
    core = EngineCore(EngineConfig(model=str(tiny_model_dirs["llama"]), device="cpu", num_gpu_blocks=16))
    assert core.config.async_scheduling is None and not core.async_scheduling
    core.set_async_scheduling(True)
    assert core.async_scheduling


def test_long_prompts_capped_beside_decodes_give_the_same_tokens(tiny_model_dirs):
    """EngineConfig.max_long_prefill_tokens changes only how prompts are chunked: greedy outputs are those of the
    uncapped synchronous engine, with and without async scheduling."""
    path = tiny_model_dirs["llama"]
    arrivals, aborts = workload(random.Random(3), False)
    ref = drive(core_for(path, False), arrivals, aborts)
    for async_on in (False, True):
        core = core_for(path, async_on, max_long_prefill_tokens=4)
        capped = []  # (prompt tokens of long prompts beside decode rows) of each step that had both
        schedule = core.scheduler.schedule

        def watched(schedule=schedule, capped=capped):
            batch = schedule()
            rows = list(zip(batch.requests, batch.num_new_tokens))
            if any(r.num_computed_tokens >= r.num_prompt_tokens for r, _ in rows):  # some row decodes
                capped.append(sum(n for r, n in rows if r.num_prompt_tokens - r.num_computed_tokens > 4))
            return batch

        core.scheduler.schedule = watched
        got = drive(core, arrivals, aborts)
        assert {r: got[r]["tokens"] for r in got} == {r: ref[r]["tokens"] for r in ref}, async_on
        # the 41-token prompt arrives with a 2-token one: beside its decoding, it came in chunks of the cap
        assert 4 in capped and max(capped) <= 4, (async_on, capped)

"""collective_rpc on a TP=2 engine (CPU, gloo): a method or a function runs on every rank and the results come back
in rank order; per-rank state persists between calls (what the PD code keeps its per-rank KV agent in); functions
may use the group's collectives; an error names its rank and leaves the engine working."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams
from tests.engine.test_vs_transformers import run_to_end

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def core(tiny_model_dirs):
    c = EngineCore(EngineConfig(model=str(tiny_model_dirs["qwen3"]), num_gpu_blocks=32, block_size=4, device="cpu",
                                dtype="float32", tensor_parallel_size=2))
    yield c
    c.close()


def remember(worker, value):
    """A PD-style set-up call: keep something per rank (e.g. a KV agent over this rank's pool)."""
    worker.extras["value"] = (worker.rank, value)
    return os.getpid(), worker.runner.kv_cache.data_ptr()


def recall(worker):
    return worker.extras["value"]


def summed_ranks(worker):
    return float(worker.tp.all_reduce(torch.tensor([worker.rank + 1.0]))[0])


def fails_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("no agent on this rank")
    return "ok"


def test_round_trip_in_rank_order(core):
    pids = core.executor.collective_rpc(remember, "x")
    assert pids[0][0] == os.getpid() and pids[1][0] != os.getpid()  # rank 1 is another process
    assert pids[0][1] == core.runner.kv_cache.data_ptr()  # rank 0's worker is the engine's own runner
    assert core.executor.collective_rpc(recall) == [(0, "x"), (1, "x")]
    assert [i["rank"] for i in core.executor.collective_rpc("kv_pool_info")] == [0, 1]


def test_functions_may_use_collectives(core):
    assert core.executor.collective_rpc(summed_ranks) == [3.0, 3.0]


def test_an_error_names_its_rank_and_the_engine_goes_on(core):
    with pytest.raises(RuntimeError, match="rank 1.*no agent on this rank"):
        core.executor.collective_rpc(fails_on_rank_1)
    assert core.executor.failed is None
    core.add_request("after", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(run_to_end(core)["after"]) == 3
    with pytest.raises(AttributeError):
        core.executor.collective_rpc("no_such_method")
    assert core.executor.collective_rpc(recall) == [(0, "x"), (1, "x")]


def test_a_call_the_worker_cannot_import_fails_alone(core, monkeypatch):
    import sys
    import types

    mod = types.ModuleType("only_in_rank0")
    exec("def f(worker):\n    return worker.rank\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, "only_in_rank0", mod)
    with pytest.raises(RuntimeError, match="rank 1.*could not be unpickled"):
        core.executor.collective_rpc(mod.f)
    assert core.executor.failed is None
    assert core.executor.collective_rpc(recall) == [(0, "x"), (1, "x")]


def test_functions_of_main_are_refused_before_sending(core):
    def local(worker):
        return 1

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="__main__"):
        core.executor.collective_rpc(local)

"""Async scheduling on a GPU: the same outputs as the synchronous engine (greedy and seeded, chunked prefill, full
decode graphs, an abort mid-stream), and `launch` never synchronizes with the host (CUDA's sync debug mode turns
any stream or device synchronization inside it into an error)."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [5, 300, 77, 1, 130, 17, 64, 9]  # prompts longer than the 96-token budget are chunked


def _core(async_on: bool) -> EngineCore:
    return EngineCore(EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="float32",
                                   num_gpu_blocks=512, max_num_batched_tokens=96, max_num_seqs=8, max_model_len=2048,
                                   async_scheduling=async_on))


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=10 + 2 * i, temperature=0.9, top_p=0.9, top_k=50, seed=i, logprobs=2,
                              ignore_eos=True)
    return SamplingParams(max_tokens=10 + 2 * i, temperature=0.0, min_tokens=3, ignore_eos=True)


def _run(core: EngineCore) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(LENGTHS):
        core.add_request(str(i), torch.randint(0, 151000, (n,), generator=g).tolist(), _params(i))
    out: dict[str, list[int]] = {}
    aborted = False
    for _ in range(2000):
        if not core.has_work():
            break
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not aborted and len(out.get("6", [])) >= 4:  # a client leaves mid-stream
            core.abort_request("6")
            aborted = True
    assert not core.has_work() and aborted
    core.check_whole()
    return out


def test_async_matches_sync_on_cuda():
    ref = _run(_core(False))
    core = _core(True)
    assert core.async_scheduling
    got = _run(core)
    assert got == ref
    assert len(got["6"]) == 4
    assert core.async_counts["overlapped"] > 10
    assert core.runner.step_counts["decode_graph"] > 0 and core.runner.step_counts["mixed_graph"] > 0


def test_launch_does_not_sync_on_cuda():
    core = _core(True)
    launch = core.runner.launch
    launches = []

    def strict_launch(*a, **k):
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
        try:
            return launch(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches.append(1)

    _run(core)  # warm: first steps may allocate, compile or grow buffers
    core.runner.launch = strict_launch
    _run(core)
    assert len(launches) > 20

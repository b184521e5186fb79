"""A dead rank fails the instance within seconds, clearly, and hangs nothing: killed while the engine idles (the
watcher notices and wakes the loop), killed right before a step (the send or the collective fails), and end to end
through the engine process: every request ends with an error, the process exits, the instance reports dead."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.executor import WorkerDied
from pdserve.errors import EngineDead
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

DETECT_S = 5.0


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), num_gpu_blocks=64, block_size=4, device="cpu", dtype="float32",
                        tensor_parallel_size=2, **kw)


def _worker_pid(core: EngineCore) -> int:
    return core.executor.collective_rpc(_pid)[1]


def _pid(worker):
    return os.getpid()


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_worker_killed_while_idle_fails_the_next_step(tiny_model_dirs):
    woken = []
    core = EngineCore(_config(tiny_model_dirs["llama"]), wake=lambda: woken.append(time.monotonic()))
    try:
        core.add_request("a", [5, 6, 7, 8], _params(50))
        core.step()
        t0 = time.monotonic()
        os.kill(_worker_pid(core), signal.SIGKILL)
        # the watcher sets `failed`, kills the ranks, then wakes the loop: wait for both (one deadline)
        while (core.executor.failed is None or not woken) and time.monotonic() - t0 < DETECT_S:
            time.sleep(0.01)
        assert core.executor.failed is not None, "the watcher did not notice the dead rank"
        assert "rank 1" in core.executor.failed and "died" in core.executor.failed
        assert woken and woken[-1] - t0 < DETECT_S, "the engine loop was not woken"
        assert core.needs_step()  # the loop steps, and the step raises
        with pytest.raises(WorkerDied, match="rank 1"):
            core.step()
        with pytest.raises(WorkerDied):
            core.executor.collective_rpc("kv_pool_info")
    finally:
        core.close()


def test_a_worker_killed_right_before_a_step_fails_that_step(tiny_model_dirs):
    core = EngineCore(_config(tiny_model_dirs["gemma3"]))
    try:
        core.add_request("a", list(range(3, 40)), _params(50))
        core.step()
        pid = _worker_pid(core)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match="rank 1"):
            for _ in range(100):  # whichever notices first: the send, the collective, or the watcher
                core.step()
        assert time.monotonic() - t0 < DETECT_S
    finally:
        core.close()


def _children(pid: int) -> list[int]:
    """The live TP worker processes whose parent is `pid` (multiprocessing's resource tracker is not one)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            ppid, state = int(stat.rsplit(")", 1)[1].split()[1]), stat.rsplit(")", 1)[1].split()[0]
            if ppid == pid and state not in "ZX" and b"pdserve.engine.worker" in cmd:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as ended)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_the_engine_process_fails_every_request_and_exits(tiny_model_dirs, tmp_path):
    """Through AsyncLLM (the engine in its own process, the worker its child): requests end with an error that
    says why, and the instance is dead (/health answers 503 from is_alive)."""
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.model.dummy_tokenizer import wordlevel_tokenizer_dir
    from pdserve.model.loader import load_config, resolve_model

    path = tiny_model_dirs["qwen3"]
    cfg, _ = load_config(resolve_model(str(path)))
    tok = wordlevel_tokenizer_dir(cfg, tmp_path)

    async def run():
        llm = AsyncLLM(_config(path, tokenizer=str(tok), max_model_len=512))
        await llm.start()
        try:
            assert llm.is_alive
            frozen = llm.info["gc_frozen"]  # each rank's process froze its start-up heap (pdserve.gc_heap)
            assert len(frozen) == 2 and min(frozen) > 10_000, frozen

            async def generate(rid: str):
                outs = []
                try:
                    async for out in llm.generate(rid, [5, 6, 7, 8], _params(400)):
                        outs.append(out)
                except EngineDead as e:
                    return outs, e
                return outs, None

            tasks = [asyncio.create_task(generate(f"r{i}")) for i in range(3)]
            while llm.stats().get("num_running", 0) < 3:
                await asyncio.sleep(0.05)
            workers = _children(llm._proc.pid)
            assert len(workers) == 1, workers
            os.kill(workers[0], signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            for outs, err in results:
                last = outs[-1] if outs else None
                if err is None:  # the engine's own error output reached the stream first
                    assert last is not None and last.finished and last.finish_reason == "error"
                    assert "rank 1" in (last.stop_reason or last.error or ""), last
                assert len([t for o in outs for t in o.new_token_ids]) < 400
            while llm.is_alive and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.05)
            assert not llm.is_alive, "the engine process should end after a rank died"
            assert time.monotonic() - t0 < 30
        finally:
            await llm.shutdown()

    asyncio.run(run())


def test_a_size_the_model_cannot_split_fails_cleanly_at_start(tiny_model_dirs):
    """TP=3 over 4 query heads: a clear error from every rank, no worker left behind, the group left (the next
    engine of this process can form one)."""
    with pytest.raises(ValueError, match="divisible by the tensor-parallel size"):
        EngineCore(EngineConfig(model=str(tiny_model_dirs["qwen3"]), num_gpu_blocks=16, block_size=4, device="cpu",
                                dtype="float32", tensor_parallel_size=3))
    assert _children(os.getpid()) == []
    core = EngineCore(_config(tiny_model_dirs["qwen3"]))
    try:
        core.add_request("a", [5, 6, 7], _params(2))
        while core.has_work():
            core.step()
    finally:
        core.close()
    assert _children(os.getpid()) == []


def test_workers_end_when_rank_0_is_killed(tiny_model_dirs):
    """Rank 0's process dies without a word (SIGKILL): its workers notice (pidfd) and exit, even mid-step."""
    import json
    import select
    import subprocess
    import sys

    cfg = dict(model=str(tiny_model_dirs["qwen3"]), device="cpu", dtype="float32", num_gpu_blocks=512,
               max_num_batched_tokens=96, max_num_seqs=8, max_model_len=512, tensor_parallel_size=2)
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-m", "tests.parallel.tp_run", "die", json.dumps(cfg)], cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line, deadline = "", time.monotonic() + 300
        while not line.startswith("WORKER_PIDS"):
            assert time.monotonic() < deadline and p.poll() is None, "the engine did not start"
            if select.select([p.stdout], [], [], 1.0)[0]:
                line = p.stdout.readline()
        worker = json.loads(line.split(maxsplit=1)[1])[0]
        p.kill()
        p.wait(10)
        t0 = time.monotonic()
        while _alive(worker) and time.monotonic() - t0 < DETECT_S:
            time.sleep(0.05)
        assert not _alive(worker), "the worker outlived rank 0"
    finally:
        if p.poll() is None:
            p.kill()

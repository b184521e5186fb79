"""Runs one engine in this process (rank 0; TP workers are its children) for the GPU tests, so every engine starts
in a fresh process as an instance's engine does, and NCCL state never carries from one engine to the next.

    python -m tests.parallel.tp_run run CONFIG_JSON OUT.pt   # the workload; tokens, logits and step counts to OUT.pt
    python -m tests.parallel.tp_run die CONFIG_JSON          # decode until a rank dies; prints WORKER_DIED <s>
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.executor import WorkerDied
from pdserve.sampling_params import SamplingParams
from tests.engine.test_vs_transformers import capture_logits, run_to_end

LENGTHS = [5, 300, 77, 1, 130, 17, 64, 9]  # prompts longer than the budget are chunked; decodes and chunks mix


def prompts(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    return {str(i): torch.randint(3, vocab - 3, (n,), generator=g).tolist() for i, n in enumerate(LENGTHS)}


def worker_pid(worker):
    return os.getpid()


def run(core: EngineCore, out_path: str) -> None:
    captured = capture_logits(core)
    for i, (rid, p) in enumerate(prompts(core.hf_config.vocab_size).items()):
        core.add_request(rid, p, SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True))
    outs = run_to_end(core)
    torch.save({"tokens": dict(outs), "logits": {k: [(n, x.cpu()) for n, x in v] for k, v in captured.items()},
                "step_counts": core.executor.collective_rpc("step_counts"),
                "pools": core.executor.collective_rpc("kv_pool_info"),
                "fast_sums": core.executor.collective_rpc("fast_sums")}, out_path)
    core.check_whole()


def die(core: EngineCore) -> None:
    for rid, p in prompts(core.hf_config.vocab_size).items():
        core.add_request(rid, p, SamplingParams(max_tokens=core.max_model_len - len(p), temperature=0.0,
                                                ignore_eos=True))
    for _ in range(20):
        core.step()
    from tests.parallel import tp_run  # this file runs as __main__: the workers import the function by this name

    print("WORKER_PIDS", json.dumps(core.executor.collective_rpc(tp_run.worker_pid)[1:]), flush=True)
    try:
        while core.has_work():
            core.step()
    except WorkerDied as e:
        print("WORKER_DIED", str(e), flush=True)


def main() -> int:
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    logging.basicConfig(level=os.environ.get("TP_RUN_LOG", "WARNING"), format="%(asctime)s %(name)s %(message)s")
    core = EngineCore(EngineConfig(**cfg))
    try:
        if mode == "run":
            run(core, sys.argv[3])
        else:
            die(core)
    finally:
        core.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NCCL's communicators may still be held (destroy_group gives up on a hung abort): skip their teardown

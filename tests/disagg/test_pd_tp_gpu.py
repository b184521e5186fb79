"""1P1D on a 2-GPU host: prefill TP=1 on cuda:0, decode TP=2 on cuda:0 and cuda:1 (NCCL), KV over the default
transport (cuda_ipc within the host, whole blocks), Qwen3-0.6B's shape with random weights in fp32 (8 KV heads: each
decode rank takes its 4 from the one prefill rank; no checkpoint, so the lent machine needs no model package): the
decode instance's answers through the handover, streaming and not, equal its own local answers; no fallback; both
pools end whole."""

from __future__ import annotations

import time

import pytest
import torch

from tests.disagg.test_pd_tp_live import post
from tests.server.live_server import LiveServer

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

# the dummy model's word-level tokenizer: word t<i> is token i (the third prompt repeats the first: a prefix hit)
PROMPTS = [" ".join(f"t{i}" for i in range(100, 180)), " ".join(f"t{i}" for i in range(900, 915)),
           " ".join(f"t{i}" for i in range(100, 180))]


def test_prefill_tp1_to_decode_tp2_on_two_gpus():
    common = ("--model", "qwen3-0.6b", "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "1024",
              "--num-gpu-blocks", "512", "--no-warmup")  # two instances share cuda:0
    servers = []
    try:
        servers.append(LiveServer(*common, "--role", "prefill", "--device", "cuda:0"))
        servers.append(LiveServer(*common, "--role", "decode", "--device", "cuda:0", "-tp", "2"))
        p, d = servers
        for stream in (False, True):
            for i, prompt in enumerate(PROMPTS):
                body = {"model": d.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}
                local = post(d.url, body)
                assert post(d.url, {**body, "pd": {"prefill_urls": [p.url], "request_id": f"g{stream}{i}"}}) == local
        assert d.get_json("/load")["pd"]["imports"] == 2 * len(PROMPTS)
        deadline = time.monotonic() + 15
        while not all(ld["num_free_blocks"] == ld["num_total_blocks"] and ld["num_running"] == 0
                      for ld in (s.get_json("/load") for s in servers)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for s in servers:
            s.stop()

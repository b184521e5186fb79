"""Prefill pushing KV layer by layer (overlapping the transfer with the remaining layers' compute) must hand over
exactly what a whole-block push does: the decode instance's greedy continuation equals its own local answer."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.server.live_server import pd_headers, start_servers, stop_servers

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of " * 6]


def post(url: str, body: dict) -> dict:
    data = json.dumps(body).encode()  # a pd order must be signed with the deployment secret
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=pd_headers(data))
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


COMMON = ("--max-model-len", "512", "--num-gpu-blocks", "96", "--kv-transport", "tcp")


@pytest.fixture(scope="module")
def servers():
    """One decode instance and a prefill instance per push mode, started at once (loading the model dominates)."""
    specs = {"on": ("--role", "prefill", "--kv-layerwise", "on"), "off": ("--role", "prefill", "--kv-layerwise", "off"),
             "decode": ("--role", "decode")}
    made = start_servers({k: (*v, *COMMON) for k, v in specs.items()})
    yield made
    stop_servers(list(made.values()))


@pytest.fixture(scope="module")
def local_answers(servers) -> dict[str, str]:
    """The decode instance's own greedy answers (no `pd`: it prefills locally), asked once for both push modes,
    each just before the first handovers of its prompt."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["on", "off"])
def test_layerwise_and_whole_pushes_give_the_local_answer(servers, local_answers, mode):
    p, d = servers[mode], servers["decode"]
    for i, prompt in enumerate(PROMPTS):
        body = {"model": d.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        if prompt not in local_answers:
            local_answers[prompt] = post(d.url, body)["choices"][0]["text"]
        local = local_answers[prompt]
        for k in range(2):  # the first may race the connection set-up and go whole; the second is layer-wise
            out = post(d.url, {**body, "pd": {"prefill_urls": [p.url], "request_id": f"x-{mode}-{i}-{k}"}})
            assert out["choices"][0]["text"] == local
            assert out["pd_timings"]["fallback"] is None
    stats = p.get_json("/load")["pd"]
    assert stats["exports"] == 2 * len(PROMPTS) and stats["export_failures"] == 0
    if mode == "on":
        assert stats["layerwise_exports"] >= len(PROMPTS)
    else:
        assert stats["layerwise_exports"] == 0
    deadline = time.monotonic() + 15
    while True:
        loads = [s.get_json("/load") for s in (p, d)]
        if all(ld["num_free_blocks"] == ld["num_total_blocks"] and ld["num_running"] == 0 for ld in loads):
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)

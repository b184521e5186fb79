"""PD between real instances that both run tensor parallelism (prefill TP=2 -> decode TP=2: two engines that each
need a process of their own), CPU, tcp, one KV agent per rank: the decode instance's answers, streaming and not and
with prefix hits on its side, equal a colocated TP=1 instance's; afterwards every pool is whole. Tiny Gemma 3
(1 KV head, replicated on both ranks: each prefill rank sends its copy to one decode rank)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from pdserve.model.dummy_tokenizer import wordlevel_tokenizer_dir
from pdserve.model.loader import load_config, resolve_model
from tests.engine.tiny_models import write_tiny_model
from tests.server.live_server import parse_sse, pd_headers, start_servers, stop_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# the word-level tokenizer of random-weight models: token id i is the word t<i>
PROMPTS = [" ".join(f"t{5 + (i * 37) % 240}" for i in range(23)), " ".join(f"t{9 + i}" for i in range(14)),
           " ".join(f"t{5 + (i * 37) % 240}" for i in range(23))]  # a repeat: a prefix hit on the decode side


def post(url: str, body: dict) -> str:
    data = json.dumps(body).encode()  # a pd field must be signed with the deployment secret
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=pd_headers(data))
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        out = json.loads(raw)
        if "pd" in body:
            assert out["pd_timings"]["fallback"] is None, out["pd_timings"]
        return out["choices"][0]["text"]
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


def test_prefill_tp2_to_decode_tp2_equals_colocated_tp1(tmp_path):
    path = write_tiny_model("gemma3", tmp_path / "gemma3")
    tok = wordlevel_tokenizer_dir(load_config(resolve_model(str(path)))[0], tmp_path)
    common = ("--model", str(path), "--tokenizer", str(tok), "--max-model-len", "256", "--num-gpu-blocks", "64", "--block-size", "4",
              "--dtype", "float32", "--kv-transport", "tcp")
    servers = []
    try:
        # the three start at once (each start is mostly one process's work at a time)
        started = start_servers({"ref": (*common, "--role", "both"), "p": (*common, "--role", "prefill", "-tp", "2"),
                                 "d": (*common, "--role", "decode", "-tp", "2")})
        servers = list(started.values())
        ref, p, d = started["ref"], started["p"], started["d"]
        for stream in (False, True):
            for i, prompt in enumerate(PROMPTS):
                body = {"model": ref.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
                want = post(ref.url, body)
                got = post(d.url, {**body, "pd": {"prefill_urls": [p.url], "request_id": f"r{stream}{i}"}})
                assert got == want, (prompt, stream)
        pd = p.get_json("/load")["pd"]
        assert pd["exports"] == 2 * len(PROMPTS) and pd["export_failures"] == 0
        load = d.get_json("/load")
        assert load["pd"]["imports"] == 2 * len(PROMPTS) and load["pd"]["fallbacks"] == 0
        assert load["prefix_cache_hits"] > 0
        deadline = time.monotonic() + 15
        while True:
            loads = [s.get_json("/load") for s in (p, d)]
            if all(ld["num_free_blocks"] == ld["num_total_blocks"] and ld["num_running"] == 0
                   and not ld["pd"]["quarantine_blocks"] for ld in loads):
                break
            assert time.monotonic() < deadline, loads
            time.sleep(0.2)
    finally:
        stop_servers(servers)

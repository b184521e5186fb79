"""What a decode instance does when no prefill instance delivers the KV: by configuration it recomputes the prefill
itself (same text as a local request) or fails the request with a clear error; either way its pool ends whole."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.server.live_server import LiveServer, pd_headers, start_servers, stop_servers

DEAD = "http://127.0.0.1:1"  # nothing listens on port 1
ARGS = ("--role", "decode", "--max-model-len", "512", "--num-gpu-blocks", "64", "--kv-transport", "tcp")


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    data = json.dumps(body).encode()  # a pd order must be signed with the deployment secret
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=pd_headers(data))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_whole(server: LiveServer, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = server.get_json("/load")
        if load["num_running"] == 0 and load["num_free_blocks"] == load["num_total_blocks"] and \
                not (load.get("pd") or {}).get("quarantine_blocks"):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"pool not whole: {load}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers():
    """Both instances, started at once (loading the model dominates); each test uses its own."""
    made = start_servers({"recompute": ARGS, "fail": (*ARGS, "--kv-fallback", "fail")})
    yield made
    stop_servers(list(made.values()))


@pytest.fixture(scope="module")
def recompute(servers):
    return servers["recompute"]


@pytest.fixture(scope="module")
def fail(servers):
    return servers["fail"]


@pytest.mark.slow
def test_unreachable_prefill_is_recomputed_locally(recompute):
    body = {"model": recompute.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    status, local = post(recompute.url, body)
    assert status == 200
    status, pd = post(recompute.url, {**body, "pd": {"prefill_urls": [DEAD], "request_id": "r1"}})
    assert status == 200, pd
    assert pd["choices"][0]["text"] == local["choices"][0]["text"]
    assert pd["pd_timings"]["fallback"] == "local"
    assert "unreachable" in pd["pd_timings"]["fallback_reason"]
    load = wait_whole(recompute)
    assert load["pd"]["fallbacks"] == 1


@pytest.mark.slow
def test_unreachable_prefill_fails_the_request_when_configured(fail):
    body = {"model": fail.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "pd": {"prefill_urls": [DEAD, DEAD], "request_id": "r2"}}
    status, err = post(fail.url, body)
    assert status == 500
    assert err["error"]["type"] == "server_error"
    assert "unreachable" in err["error"]["message"] and "127.0.0.1:1" in err["error"]["message"]
    wait_whole(fail)
    # the instance still serves requests it prefills itself
    status, ok = post(fail.url, {k: v for k, v in body.items() if k != "pd"})
    assert status == 200 and ok["usage"]["completion_tokens"] == 8

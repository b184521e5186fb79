"""Unit tests: configuration, prefix hashing, policies, circuit breaker, SSE filter."""

from __future__ import annotations

import json

import pytest

from pdserve.router.config import RouterConfig, normalize_url
from pdserve.router.policies import POLICIES, RouteRequest, make_policy
from pdserve.router.pool import BreakerState, CircuitBreaker, Instance, LoadSnapshot
from pdserve.router.prefix import PrefixIndex, chunk_hashes, prompt_text
from pdserve.router.sse import SSEFilter


def make_config(**kw) -> RouterConfig:
    kw.setdefault("decode", ["127.0.0.1:9000"])
    return RouterConfig(**kw)


def instances(n: int, role: str = "prefill", config: RouterConfig | None = None) -> list[Instance]:
    config = config or make_config()
    return [Instance(f"http://127.0.0.1:{7000 + i}", role, config) for i in range(n)]


# ---- config ----


def test_config_validates_and_normalizes(tmp_path):
    assert normalize_url("localhost:8001/") == "http://localhost:8001"
    with pytest.raises(ValueError, match="http://host:port"):
        normalize_url("localhost")
    with pytest.raises(ValueError, match="at least one decode"):
        RouterConfig(prefill=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig(prefill=["127.0.0.1:1"], decode=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="prefill_policy"):
        make_config(prefill_policy="random")
    with pytest.raises(ValueError, match="health_timeout_s"):
        make_config(health_timeout_s=0)
    path = tmp_path / "router.yaml"
    path.write_text("prefill: [127.0.0.1:8001, 127.0.0.1:8002]\ndecode: 127.0.0.1:8003\npolicy_typo: 1\n")
    with pytest.raises(ValueError, match="unknown router config keys"):
        RouterConfig.from_yaml(path)
    path.write_text("prefill: [127.0.0.1:8001, 127.0.0.1:8002]\ndecode: 127.0.0.1:8003\nkv_beta: 2.0\nport: 9\n")
    cfg = RouterConfig.from_yaml(path, port=8080)
    assert cfg.prefill == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert cfg.decode == ["http://127.0.0.1:8003"] and cfg.kv_beta == 2.0 and cfg.port == 8080
    assert cfg.role_of("127.0.0.1:8002") == "prefill"


# ---- prefix hashing ----


def test_chunk_hashes_chain_over_prefixes():
    a = chunk_hashes("x" * 64 + "y" * 64 + "z" * 10, 64)
    b = chunk_hashes("x" * 64 + "y" * 64 + "w" * 70, 64)
    c = chunk_hashes("q" * 64 + "y" * 64, 64)
    assert len(a) == 2 and a == b[:2] and b[2] not in a
    assert c[1] != a[1]  # same chunk text after a different prefix hashes differently
    idx = PrefixIndex(capacity=3)
    idx.insert(a)
    assert idx.overlap(b) == 2 and idx.overlap(c) == 0
    idx.insert(c)  # capacity 3: the least recently used hash (a[0]) goes
    assert len(idx) == 3 and idx.overlap(a) == 0


def test_prompt_text_renders_chat_prefix_stably():
    m1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]}
    m2 = {"messages": m1["messages"] + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]}
    t1, t2 = prompt_text("/v1/chat/completions", m1), prompt_text("/v1/chat/completions", m2)
    assert t2.startswith(t1)
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text("/v1/completions", {"prompt": ["a", "b"]}) == "a"


# ---- policies ----


def test_round_robin_rotates():
    pol = make_policy("round_robin", make_config())
    insts = instances(3)
    firsts = [pol.rank(insts, RouteRequest(10))[0].url for _ in range(6)]
    assert firsts == [i.url for i in insts] * 2
    assert sorted(i.url for i in pol.rank(insts, RouteRequest(10))) == sorted(i.url for i in insts)


def test_least_loaded_uses_polled_and_pending_tokens():
    pol = make_policy("least_loaded", make_config())
    a, b, c = instances(3)
    a.load = LoadSnapshot(running_tokens=100, waiting_tokens=50)
    b.load = LoadSnapshot(running_tokens=10)
    c.load = LoadSnapshot(running_tokens=10, waiting_tokens=5)
    assert [i.url for i in pol.rank([a, b, c], RouteRequest(1))] == [b.url, c.url, a.url]
    b.pending_tokens = 200  # dispatched since the poll
    assert pol.rank([a, b, c], RouteRequest(1))[0] is c


def test_kv_aware_trades_cached_prefix_against_load():
    cfg = make_config(kv_alpha=1.0, kv_beta=0.5, prefix_chunk_chars=16, chars_per_token=4.0)
    pol = make_policy("kv_aware", cfg)
    a, b = instances(2, config=cfg)
    text = "abcdefghijklmnop" * 20  # 20 chunks of 16 chars = 4 tokens each -> 80 tokens
    req = RouteRequest(80, chunk_hashes(text, 16), tokens_per_chunk=4.0)
    a.prefix.insert(req.hashes)  # a has all 80 tokens cached
    a.load = LoadSnapshot(running_tokens=100)  # score a: 80 - 50 = 30
    b.load = LoadSnapshot(running_tokens=0)  # score b: 0
    assert pol.rank([a, b], req)[0] is a
    a.load = LoadSnapshot(running_tokens=400)  # score a: 80 - 200 < 0: the cache is not worth the queue
    assert pol.rank([a, b], req)[0] is b
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope", cfg)
    assert {"round_robin", "least_loaded", "kv_aware"} <= set(POLICIES)


# ---- circuit breaker ----


def test_breaker_opens_half_opens_and_closes():
    now = [0.0]
    br = CircuitBreaker(failures=3, cooldown_s=5.0, clock=lambda: now[0])
    br.record_failure()
    br.record_failure()
    assert br.state is BreakerState.CLOSED
    br.record_success()  # resets the count
    for _ in range(2):
        br.record_failure()
    assert br.state is BreakerState.CLOSED
    br.record_failure()
    assert br.state is BreakerState.OPEN and not br.allows_requests
    br.record_success()  # a late success does not close an open breaker before the cool-down
    assert br.state is BreakerState.OPEN
    now[0] = 5.0
    assert br.state is BreakerState.HALF_OPEN and not br.allows_requests
    br.record_failure()  # the probe failed: open again for a full cool-down
    assert br.state is BreakerState.OPEN
    now[0] = 9.0
    assert br.state is BreakerState.OPEN
    now[0] = 10.5
    assert br.state is BreakerState.HALF_OPEN
    br.record_success()
    assert br.state is BreakerState.CLOSED and br.allows_requests


def test_load_snapshot_rejects_garbage():
    assert LoadSnapshot.from_json({"num_running": 2, "role": "decode"}).num_running == 2
    with pytest.raises(ValueError, match="num_waiting"):
        LoadSnapshot.from_json({"num_waiting": "many"})
    with pytest.raises(ValueError, match="expected an object"):
        LoadSnapshot.from_json([1])


# ---- SSE filter ----


def _events(data: bytes) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]" for e in data.split(b"\n\n") if e]


def test_sse_filter_handles_split_chunks_and_usage():
    chunk = {"choices": [{"index": 0, "text": "hi"}], "usage": None}
    usage = {"choices": [], "usage": {"total_tokens": 3}, "pd_timings": {"prefill_s": 0.1}}
    stream = b"".join(b"data: " + json.dumps(x).encode() + b"\n\n" for x in (chunk, usage)) + b"data: [DONE]\n\n"
    for wants_usage in (False, True):
        f = SSEFilter(client_wants_usage=wants_usage)
        out = b"".join(f.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + f.flush()
        events = _events(out)
        assert f.saw_done and f.timings == [{"prefill_s": 0.1}]
        if wants_usage:
            assert events == [chunk, {"choices": [], "usage": {"total_tokens": 3}}, "[DONE]"]
        else:
            assert events == [{"choices": [{"index": 0, "text": "hi"}]}, "[DONE]"]


def test_sse_filter_fast_path_strips_null_usage_without_changing_the_rest():
    compact = b'data: {"id":"x","choices":[{"index":0,"text":"a \\"usage\\":null"}],"usage":null}\n\n'
    spaced = b'data: {"id": "x", "choices": [{"index": 0, "text": "b"}], "usage": null}\n\n'
    f = SSEFilter(client_wants_usage=False)
    out = f.feed(compact + spaced)
    assert _events(out) == [{"id": "x", "choices": [{"index": 0, "text": 'a "usage":null'}]},
                            {"id": "x", "choices": [{"index": 0, "text": "b"}]}]
    f = SSEFilter(client_wants_usage=True)
    assert f.feed(compact + spaced) == compact + spaced  # asked for usage: bytes untouched


def test_prompt_key_of_token_ids_is_exact_and_shares_prefixes():
    from pdserve.router.prefix import prompt_key

    a = prompt_key("/v1/completions", {"prompt": list(range(100))}, 64, 4.0)
    b = prompt_key("/v1/completions", {"prompt": list(range(40)) + [7] * 60}, 64, 4.0)
    assert a.est_tokens == 100 and a.tokens_per_chunk == 16.0 and len(a.hashes) == 6  # 6 full chunks of 16 ids
    assert a.hashes[:2] == b.hashes[:2] and a.hashes[2] != b.hashes[2]  # ids 0..31 shared, 32..47 differ
    text = prompt_key("/v1/completions", {"prompt": "x" * 130}, 64, 4.0)
    assert text.est_tokens == 33 and len(text.hashes) == 2
    odd = prompt_key("/v1/completions", {"prompt": [1, "a", 2]}, 64, 4.0)  # not ids: estimated from its text
    assert odd.est_tokens >= 1


def test_extend_json_object_appends_without_reencoding():
    import json

    from pdserve.server.body import extend_json_object

    raw = b' {"prompt": [1, 2, 3], "note": "caf\\u00e9"}\n'
    obj = json.loads(raw)
    out = extend_json_object(raw, obj, {"pd": {"request_id": "r"}})
    assert out.startswith(b'{"prompt": [1, 2, 3], "note": "caf\\u00e9"') and json.loads(out) == {**obj, "pd": {"request_id": "r"}}
    assert extend_json_object(raw, obj, {}) is raw
    again = extend_json_object(raw, obj, {"note": "x"})  # a member it has: re-encoded, never repeated
    assert again.count(b'"note"') == 1 and json.loads(again)["note"] == "x"
    assert json.loads(extend_json_object(b"{}", {}, {"a": 1})) == {"a": 1}

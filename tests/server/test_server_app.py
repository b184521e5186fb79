"""The HTTP layer around a scripted engine: response shapes, SSE framing, error statuses, aborts, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from pdserve.config import EngineConfig, KVTransferConfig, ServerConfig
from pdserve.engine.messages import ImportParams
from pdserve.server.app import create_app
from pdserve.server.body import RUNNER_OPTIONS
from pdserve.signing import sign_request
from tests.server.live_server import parse_sse
from tests.server.scripted_engine import WORD, ScriptedLLM

pytestmark = pytest.mark.timeout(60)


def serve(test: Callable[[aiohttp.ClientSession, str, ScriptedLLM], Awaitable[None]], llm=None, timeout_s=600.0,
          **config: object):
    """Run `test(session, base_url, llm)` against the app on a loopback port, cancelling handlers on disconnect."""
    llm = llm or ScriptedLLM()
    secret = config.pop("secret", None)
    engine = EngineConfig(model="scripted", kv_transfer=KVTransferConfig(secret=secret.encode() if secret else None))
    config = ServerConfig(engine=engine, request_timeout_s=timeout_s, **config)

    async def main() -> None:
        server = TestServer(create_app(llm, config))
        await server.start_server(**RUNNER_OPTIONS)  # handler_cancellation is on in test servers
        try:
            async with aiohttp.ClientSession() as session:
                await test(session, str(server.make_url("")).rstrip("/"), llm)
        finally:
            await server.close()

    asyncio.run(main())
    return llm


async def sse_events(resp: aiohttp.ClientResponse) -> list:
    """Parse a whole SSE body: every event must be `data: <json or [DONE]>` followed by a blank line."""
    raw = (await resp.read()).decode()
    return parse_sse(raw)


async def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_info_routes():
    async def t(s, url, llm):
        async with s.get(url + "/health") as r:
            assert r.status == 200
        async with s.get(url + "/version") as r:
            assert (await r.json())["version"]
        async with s.get(url + "/v1/models") as r:
            data = (await r.json())["data"]
            assert [m["id"] for m in data] == ["scripted"] and data[0]["max_model_len"] == llm.max_model_len
        async with s.get(url + "/v1/models/scripted") as r:
            assert (await r.json())["id"] == "scripted"
        async with s.get(url + "/v1/models/other") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with s.get(url + "/load") as r:
            load = await r.json()
            assert load["num_total_blocks"] == llm.stats()["num_total_blocks"] and load["role"] == "both"

    serve(t)


def test_completion_whole_response():
    async def t(s, url, llm):
        prompt = "héllo"
        async with s.post(url + "/v1/completions", json={"model": "scripted", "prompt": prompt, "max_tokens": 5}) as r:
            assert r.status == 200
            body = await r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": WORD[:5], "logprobs": None, "finish_reason": "length"}]
        assert body["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(prompt))
        assert body["usage"]["completion_tokens"] == 5
        assert body["usage"]["total_tokens"] == 5 + len(llm.tokenizer.encode(prompt))

    serve(t)


def test_completion_stream_with_usage_and_echo():
    async def t(s, url, llm):
        req = {"prompt": "hi", "max_tokens": 4, "stream": True, "echo": True, "stream_options": {"include_usage": True}}
        async with s.post(url + "/v1/completions", json=req) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        *content, finish, usage = chunks
        assert all(c["usage"] is None for c in content + [finish])
        assert "".join(c["choices"][0]["text"] for c in content) == "hi" + WORD[:4]
        assert all(c["choices"][0]["finish_reason"] is None for c in content)
        assert finish["choices"][0]["finish_reason"] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
        assert usage["usage"]["prompt_tokens"] == 2

    serve(t)


def test_chat_stream_and_whole():
    async def t(s, url, llm):
        msgs = [{"role": "user", "content": "hi"}]
        async with s.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}) as r:
            body = await r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"] == {"role": "assistant", "content": WORD[:3]}
        assert body["usage"]["prompt_tokens"] == len(llm.tokenizer.encode_chat(msgs))
        async with s.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "stream": True}) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        first, *content, finish = events[:-1]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"]["content"] for c in content) == WORD[:3]
        assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        assert all("usage" not in c for c in events[:-1])

    serve(t)


def test_logprobs_shapes():
    async def t(s, url, llm):
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 2}) as r:
            lp = (await r.json())["choices"][0]["logprobs"]
        assert lp["tokens"] == list(WORD[:2]) and lp["text_offset"] == [0, 1]
        assert lp["top_logprobs"][0] == {"a": -0.25, "b": -1.5}
        msgs = [{"role": "user", "content": "x"}]
        body = {"messages": msgs, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            content = (await r.json())["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == list(WORD[:2])
        assert content[0]["top_logprobs"] == [{"token": "a", "logprob": -0.25, "bytes": [ord("a")]}]

    serve(t)


SECRET = "test-deployment-secret-0123456789"


def test_pd_field_is_honoured_only_when_signed():
    async def t(s, url, llm):
        pd = {"prefill_urls": ["http://127.0.0.1:9"], "request_id": "rt-1"}
        body = json.dumps({"prompt": "x", "max_tokens": 1, "pd": pd}).encode()
        post = url + "/v1/completions"
        async with s.post(post, data=body) as r:
            assert (await expect_error(r, 401))["code"] == "missing_signature"
        wrong = sign_request(b"another-secret-of-enough-length", "POST", "/v1/completions", body)
        async with s.post(post, data=body, headers=wrong) as r:
            assert (await expect_error(r, 401))["code"] == "invalid_signature"
        headers = sign_request(SECRET.encode(), "POST", "/v1/completions", body)
        async with s.post(post, data=body[:-1] + b" }", headers=headers) as r:  # the body was altered
            assert (await expect_error(r, 401))["code"] == "invalid_signature"
        async with s.post(post, data=body, headers=headers) as r:
            assert r.status == 200
        async with s.post(post, data=body, headers=headers) as r:
            assert (await expect_error(r, 401))["code"] == "replayed_signature"

        async def signed(pd: object) -> aiohttp.ClientResponse:
            b = json.dumps({"prompt": "x", "max_tokens": 1, "pd": pd}).encode()
            return await s.post(post, data=b, headers=sign_request(SECRET.encode(), "POST", "/v1/completions", b))

        async with await signed({}) as r:
            assert r.status == 200  # no prefill candidate: a local prefill
        async with await signed({"prefill_urls": "nope"}) as r:
            assert (await expect_error(r, 400))["param"] == "pd"
        assert llm.seen_kv == [ImportParams(("http://127.0.0.1:9",), "rt-1"), None]

    serve(t, secret=SECRET)


def test_pd_field_is_refused_without_a_deployment_secret():
    async def t(s, url, llm):
        body = json.dumps({"prompt": "x", "max_tokens": 1, "pd": {"k": 1}}).encode()
        headers = sign_request(SECRET.encode(), "POST", "/v1/completions", body)
        async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
            assert (await expect_error(r, 401))["code"] == "no_deployment_secret"
        assert llm.seen_kv == []

    serve(t)


async def expect_error(resp: aiohttp.ClientResponse, status: int) -> dict:
    assert resp.status == status, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/json")
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


def test_error_statuses():
    async def t(s, url, llm):
        post = url + "/v1/completions"
        async with s.post(post, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            assert "not valid JSON" in (await expect_error(r, 400))["message"]
        async with s.post(post, data=b"") as r:
            await expect_error(r, 400)
        async with s.post(post, json={"model": "nope", "prompt": "x"}) as r:
            assert (await expect_error(r, 404))["code"] == "model_not_found"
        async with s.post(post, json={"prompt": "x", "temperature": -1}) as r:
            assert (await expect_error(r, 400))["param"] == "temperature"
        async with s.post(post, json={"prompt": [1, llm.tokenizer.vocab_size]}) as r:
            assert (await expect_error(r, 400))["param"] == "prompt"
        long = "x" * (llm.max_model_len + 5)
        async with s.post(post, json={"prompt": long, "max_tokens": 1}) as r:
            err = await expect_error(r, 400)
        assert err["code"] == "context_length_exceeded"
        assert str(llm.max_model_len) in err["message"] and str(len(long)) in err["message"]
        chat = {"messages": [{"role": "assistant", "content": "x"}]}
        async with s.post(url + "/v1/chat/completions", json=chat) as r:
            assert "chat template" in (await expect_error(r, 400))["message"]
        async with s.get(url + "/v1/nothing") as r:
            await expect_error(r, 404)
        async with s.get(post) as r:
            await expect_error(r, 405)
        llm.mode = "queue_full"
        async with s.post(post, json={"prompt": "x"}) as r:
            await expect_error(r, 503)
            assert r.headers["Retry-After"] == "2"
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'pdserve:requests_total{model_name="scripted",outcome="rejected"} 1.0' in text.splitlines()

    serve(t)


def test_engine_error_is_reported_not_leaked():
    async def t(s, url, llm):
        llm.mode = "error_after"
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8}) as r:
            assert "device fell over" in (await expect_error(r, 500))["message"]
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True}) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]" and "device fell over" in events[-2]["error"]["message"]
        llm.mode = "die_after"
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8}) as r:
            assert "engine stopped" in (await expect_error(r, 503))["message"]
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True}) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]" and "EngineDead" in events[-2]["error"]["message"]
        assert not llm.open

    serve(t)


def test_client_disconnect_mid_stream_aborts_the_request():
    async def t(s, url, llm):
        body = {"prompt": "x", "max_tokens": 100, "stream": True}
        r = await s.post(url + "/v1/completions", json=body)
        for _ in range(3):
            assert (await r.content.readuntil(b"\n\n")).startswith(b"data: ")
        assert len(llm.open) == 1
        r.close()
        await wait_until(lambda: not llm.open)
        assert len(llm.aborted) == 1

    serve(t, ScriptedLLM(step_s=0.01))


def test_client_disconnect_before_first_token_aborts_the_request():
    async def t(s, url, llm):
        llm.mode = "stall"
        with pytest.raises(asyncio.TimeoutError):
            await s.post(url + "/v1/completions", json={"prompt": "x"}, timeout=aiohttp.ClientTimeout(total=0.3))
        await wait_until(lambda: not llm.open)
        assert len(llm.aborted) == 1

    serve(t)


def test_request_timeout_gives_504_and_frees_the_request():
    async def t(s, url, llm):
        llm.mode = "stall"
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert (await expect_error(r, 504))["code"] == "timeout"
        assert not llm.open

        async with s.get(url + "/metrics") as r:
            text = await r.text()
        outcomes = [line for line in text.splitlines() if line.startswith("pdserve:requests_total{")]
        assert outcomes == ['pdserve:requests_total{model_name="scripted",outcome="timeout"} 1.0']

    serve(t, timeout_s=0.3)


def test_metrics_after_traffic():
    async def t(s, url, llm):
        async with s.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}) as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json={"prompt": "x", "n": 0}) as r:
            assert r.status == 400
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        label = 'model_name="scripted"'
        assert values[f'pdserve:requests_total{{{label},outcome="length"}}'] == 1
        assert values[f'pdserve:requests_total{{{label},outcome="invalid"}}'] == 1
        assert values[f"pdserve:prompt_tokens_total{{{label}}}"] == 3
        assert values[f"pdserve:generation_tokens_total{{{label}}}"] == 3
        assert values[f"pdserve:time_to_first_token_seconds_count{{{label}}}"] == 1
        assert values[f"pdserve:inter_token_latency_seconds_count{{{label}}}"] == 2
        assert values[f"pdserve:e2e_request_latency_seconds_count{{{label}}}"] == 1
        assert values[f"pdserve:request_queue_time_seconds_count{{{label}}}"] == 1
        stats = llm.stats()
        assert (
            values[f"pdserve:prefix_cache_hit_rate{{{label}}}"]
            == stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
        )
        assert values[f"pdserve:kv_cache_total_blocks{{{label}}}"] == stats["num_total_blocks"]
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f"pdserve:{name}{{{label}}}" in values

    serve(t)


def test_latency_clock_starts_before_tokenization():
    """The TTFT and E2E histograms run from the request's arrival (its body read), so a slow tokenization counts,
    as in vLLM's, whose renderer stamps arrival_time before it tokenizes."""
    async def t(s, url, llm):
        llm.tokenizer.delay_s = 0.4
        for path, body in (("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
            async with s.post(url + path, json=body) as r:
                assert r.status == 200
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        label = 'model_name="scripted"'
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            assert float(values[f"pdserve:{name}_count{{{label}}}"]) == 2
            assert float(values[f"pdserve:{name}_sum{{{label}}}"]) >= 2 * 0.4, name

    serve(t)


def test_tokenization_does_not_block_the_event_loop():
    async def t(s, url, llm):
        llm.tokenizer.delay_s = 1.0
        slow = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}))
        await asyncio.sleep(0.1)  # the slow request is now tokenizing
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.get(url + "/health") as r:
            assert r.status == 200
        assert loop.time() - t0 < 0.5, "a request waited for another request's tokenization"
        assert not slow.done()
        async with await slow as r:
            assert r.status == 200

    serve(t)

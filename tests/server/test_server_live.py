"""A real server process with the default model on CPU, called with the official `openai` client.

One server for the module (starting one loads the model); generations stay short so the module runs in well
under a minute on two cores.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from tests.server.live_server import LiveServer, parse_sse

openai = pytest.importorskip("openai")  # a test dependency; absent on the GPU image

pytestmark = pytest.mark.timeout(600)

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-model-len", str(MAX_MODEL_LEN), "--log-stats-interval", "0.5")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.model.loader import resolve_model

    return Tokenizer.load(str(resolve_model(None).path))


PROMPT = "The three primary colours are"
CHAT = [{"role": "user", "content": "Name three colours."}]


def pool_is_whole(server: LiveServer, timeout_s: float = 30.0) -> dict:
    """Poll /load until nothing runs or waits and every KV block is free again; the last snapshot."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = server.get_json("/load")
        if (
            load["num_running"] == 0
            and load["num_waiting"] == 0
            and load["num_free_blocks"] == load["num_total_blocks"]
        ):
            return load
        assert time.monotonic() < deadline, f"KV pool not whole after {timeout_s:g} s: {load}"
        time.sleep(0.05)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    assert server.get_json("/version")["version"]
    assert server.role == "both"


def test_completion_usage_equals_tokenizer_count(client, server, tokenizer):
    r = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.choices[0].text


def test_token_id_prompt_matches_text_prompt(client, server, tokenizer):
    args = dict(model=server.model, max_tokens=6, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **args)
    by_ids = client.completions.create(prompt=tokenizer.encode(PROMPT), **args)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_stream_matches_whole(client, server):
    args = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_chat_whole_and_stream(client, server, tokenizer):
    args = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT, add_generation_prompt=True))
    assert 1 <= whole.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stop_strings(client, server):
    args = dict(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **args).choices[0].text
    assert len(full) >= 4, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = full.index(stop)
    r = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **args).choices[0]
    assert (r.text, r.finish_reason) == (full[:cut], "stop")
    r = client.completions.create(
        stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **args
    ).choices[0]
    assert r.text == full[: cut + len(stop)]
    streamed = client.completions.create(stop=[stop], stream=True, extra_body={"ignore_eos": True}, **args)
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]


def test_seeds_reproduce_and_differ(client, server):
    args = dict(model=server.model, prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(seed=7, **args).choices[0].text
    assert client.completions.create(seed=7, **args).choices[0].text == first
    others = {client.completions.create(seed=s, **args).choices[0].text for s in (8, 9)}
    assert others != {first}


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)


def post_raw(server: LiveServer, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_invalid_requests_get_openai_errors(client, server, tokenizer):
    status, body = post_raw(server, "/v1/completions", b'{"prompt": "x", ')
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = post_raw(server, "/v1/chat/completions", json.dumps({"model": server.model}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, n=2, temperature=0)
    assert e.value.status_code == 400 and "n must be 1 when using greedy sampling" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=[[1, 2], []])
    assert "prompt[1]" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    long_prompt = "hello " * MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=long_prompt, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in e.value.message and str(len(tokenizer.encode(long_prompt))) in e.value.message
    assert server.proc.poll() is None  # nothing above hurt the server


def test_disconnect_mid_stream_frees_the_kv_pool(server):
    total = server.get_json("/load")["num_total_blocks"]

    async def run() -> None:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s:
            r = await s.post(server.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120))
            assert r.status == 200
            for _ in range(3):
                assert (await r.content.readuntil(b"\n\n")).startswith(b"data: {")
            assert server.get_json("/load")["num_running"] == 1
            r.close()

    asyncio.run(run())
    load = pool_is_whole(server)
    assert load["num_total_blocks"] == total


async def one_stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> list:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    return parse_sse(raw)


def test_64_concurrent_streams_all_complete(server, tokenizer):
    n, max_tokens = 64, 8
    prompts = [f"Story number {i}: once upon a time" for i in range(n)]

    async def run() -> list:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=n)) as s:
            return await asyncio.gather(*(one_stream(s, server.url, server.model, p, max_tokens) for p in prompts))

    results = asyncio.run(run())
    ids = set()
    for prompt, events in zip(prompts, results):
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        chunks, usage = events[:-2], events[-2]
        assert len({c["id"] for c in events[:-1]}) == 1
        ids.add(chunks[0]["id"])
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == max_tokens
        assert usage["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert len(ids) == n
    pool_is_whole(server)


def test_metrics_after_traffic(server):
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    label = f'model_name="{server.model}"'
    assert values[f'pdserve:requests_total{{{label},outcome="length"}}'] >= 64
    assert values[f'pdserve:requests_total{{{label},outcome="invalid"}}'] >= 5
    assert values[f"pdserve:generation_tokens_total{{{label}}}"] >= 64 * 8
    assert values[f"pdserve:time_to_first_token_seconds_count{{{label}}}"] >= 64
    assert values[f"pdserve:kv_cache_total_blocks{{{label}}}"] == server.get_json("/load")["num_total_blocks"]
    assert values[f"pdserve:prefix_cache_queries_total{{{label}}}"] > 0
    assert values[f"pdserve:engine_steps_total{{{label}}}"] >= 8  # 64 requests of 8 tokens, batched
    assert values[f"pdserve:engine_gpu_wait_seconds_total{{{label}}}"] > 0
    # the engine's stats line (--log-stats-interval 0.5): the traffic above was logged with its rates
    lines = [ln for ln in server.lines if "pdserve.server.stats: engine: prompt " in ln]
    assert any(" generation 0.0 tokens/s" not in ln for ln in lines), server.output()
    assert all("ms a step" in ln or "no steps" in ln for ln in lines), lines

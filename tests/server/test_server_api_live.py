"""vLLM's API extensions on a real colocated instance (default model, CPU), called with the official `openai` client:
n with a seed, batch prompts, presence/frequency/repetition penalties, logit_bias, /tokenize and /detokenize, API
keys, and an aborted stream's clean end. Expected values are computed, never typed: each n-choice equals a single
request with vLLM's child seed, each batch choice the prompt asked alone, and the penalised greedy output a
step-by-step reference built from the raw top-20 logprobs."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest

from tests.server.live_server import LiveServer, pd_headers

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

KEY = "sk-live-test"
PROMPT = "The three primary colours are"
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-model-len", "1024", "--api-key", KEY)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def root(server):
    """The same server at its root, for vLLM's /tokenize and /detokenize."""
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def pool_is_whole(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url + "/load", timeout=10) as r:
            load = json.loads(r.read())
        if load["num_running"] == 0 and load["num_waiting"] == 0 and load["num_pending"] == 0 \
                and load["num_free_blocks"] == load["num_total_blocks"]:
            return load
        assert time.monotonic() < deadline, f"KV pool not whole after {timeout_s:g} s: {load}"
        time.sleep(0.1)


def ids_of(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_api_key_is_required(server, client):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=server.model, prompt="x", max_tokens=1)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).post(
            "/tokenize", body={"prompt": "x"}, cast_to=object)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:  # open, as in vLLM
        assert r.status == 200
    assert client.models.list().data[0].id == server.model


def test_n_with_a_seed_gives_vllms_child_seeds(server, client):
    args = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(n=4, seed=1234, **args)
    again = client.completions.create(n=4, seed=1234, **args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in again.choices] == texts  # reproducible
    assert len(set(texts)) == 4, texts  # distinct
    singles = [client.completions.create(seed=1234 + i, **args).choices[0].text for i in range(4)]
    assert singles == texts  # choice i is the request with seed + i, as vLLM derives it
    assert first.usage.completion_tokens == 32 and first.usage.prompt_tokens == again.usage.prompt_tokens
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, n=3, seed=7)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    pool_is_whole(server.url)


def test_batch_prompts_in_order_with_summed_usage(server, client):
    args = dict(model=server.model, max_tokens=6, temperature=0)
    alone = [client.completions.create(prompt=p, **args) for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    seeded = dict(model=server.model, max_tokens=4, temperature=1.0, seed=99, n=2)
    both = client.completions.create(prompt=PROMPTS[:2], **seeded)
    each = [client.completions.create(prompt=p, **seeded) for p in PROMPTS[:2]]
    assert [c.text for c in both.choices] == [c.text for e in each for c in e.choices]  # index = prompt * n + i
    streamed = client.completions.create(prompt=PROMPTS, stream=True, **args)
    text = {i: "" for i in range(3)}
    for chunk in streamed:
        for c in chunk.choices:
            text[c.index] += c.text
    assert list(text.values()) == [a.choices[0].text for a in alone]
    pool_is_whole(server.url)


def penalised_reference(client, model: str, prompt_ids: list[int], steps: int, presence: float,
                        frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's presence/frequency penalties, one raw top-20 distribution at a time: the
    penalised logprob of token t is logprob(t) - frequency * count(t) - presence * [count(t) > 0]."""
    out: list[int] = []
    for _ in range(steps):
        r = client.completions.create(model=model, prompt=prompt_ids + out, max_tokens=1, temperature=0, logprobs=20,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        top = {int(k.removeprefix("token_id:")): v for k, v in r.choices[0].logprobs.top_logprobs[0].items()}
        score = {t: lp - frequency * out.count(t) - presence * (t in out) for t, lp in top.items()}
        best = max(score, key=score.get)
        assert score[best] >= min(top.values()), "the penalised best lies outside the top 20: no reference"
        out.append(best)
    return out


def test_presence_and_frequency_penalties_follow_the_definition(server, client, root):
    prompt_ids = root.post("/tokenize", body={"prompt": "one one one one one one one"}, cast_to=object)["tokens"]
    steps = 6
    for presence, frequency in ((0.0, 1.5), (1.2, 0.0), (0.8, 0.6)):
        r = client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=steps, temperature=0,
                                      logprobs=0, presence_penalty=presence, frequency_penalty=frequency,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        want = penalised_reference(client, server.model, prompt_ids, steps, presence, frequency)
        assert ids_of(r.choices[0]) == want, (presence, frequency)
    plain = client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=steps, temperature=0,
                                      logprobs=0, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert ids_of(plain.choices[0]) == penalised_reference(client, server.model, prompt_ids, steps, 0.0, 0.0)
    assert ids_of(plain.choices[0]) != want  # the penalties changed the output


def test_repetition_penalty_neutral_and_effective(server, client):
    args = dict(model=server.model, prompt="a a a a a a a a a a", max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    neutral = client.completions.create(**{**args, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.0}})
    strong = client.completions.create(**{**args, "extra_body": {"ignore_eos": True, "repetition_penalty": 3.0}})
    assert neutral.choices[0].text == plain and plain.startswith(" a a")
    assert not strong.choices[0].text.startswith(" a a"), strong.choices[0].text  # the prompt's token is penalised


def test_logit_bias(server, client, root):
    args = dict(model=server.model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                extra_body={"return_tokens_as_token_ids": True})
    raw = client.completions.create(**args).choices[0]
    top1, top2 = [int(k.removeprefix("token_id:")) for k in raw.logprobs.top_logprobs[0]]
    banned = client.completions.create(logit_bias={str(top1): -100}, **args).choices[0]
    assert ids_of(banned) == [top2]
    forced_id = root.post("/tokenize", body={"prompt": " zebra", "add_special_tokens": False},
                          cast_to=object)["tokens"][0]
    forced = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0.8, seed=3,
                                       logit_bias={str(forced_id): 100}, logprobs=0,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert ids_of(forced.choices[0]) == [forced_id] * 5


def test_tokenize_detokenize_round_trip(server, root):
    text = "Hello, wörld! 👋"
    tok = root.post("/tokenize", body={"prompt": text, "return_token_strs": True}, cast_to=object)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    assert len(tok["token_strs"]) == tok["count"]
    detok = root.post("/detokenize", body={"tokens": tok["tokens"]}, cast_to=object)
    plain = root.post("/tokenize", body={"prompt": text, "add_special_tokens": False}, cast_to=object)
    assert detok["prompt"].endswith(text) and tok["tokens"][-len(plain["tokens"]):] == plain["tokens"]
    assert root.post("/detokenize", body={"tokens": plain["tokens"]}, cast_to=object)["prompt"] == text
    chat = root.post("/tokenize", body={"messages": [{"role": "user", "content": "Hi"}]}, cast_to=object)
    assert chat["count"] > 2


def test_abort_ends_the_stream_cleanly(server):
    async def go() -> str:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                rid = r.headers["X-Request-Id"]
                raw = await r.content.readuntil(b"\n\n")
                abort = json.dumps({"request_id": rid}).encode()
                async with s.post(server.url + "/v1/abort", data=abort) as a:
                    assert a.status == 401  # only the deployment's own processes abort by id
                async with s.post(server.url + "/v1/abort", data=abort, headers=pd_headers(abort, "/v1/abort")) as a:
                    assert (await a.json())["found"] is True
                raw += await r.read()
        return raw.decode()

    raw = asyncio.run(go())
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and "Generation failed" not in raw and '"error"' not in raw
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    pool_is_whole(server.url)

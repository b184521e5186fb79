"""vLLM's API extensions through the router and the PD handover (1 prefill + 1 decode instance, default model,
CPU, tcp), with the official `openai` client: n with a seed, batch prompts, penalties, logit_bias, tokenize and
detokenize, API keys. The decode instance fans out n and batch prompts and each choice goes through its own
signed handover; every answer must equal the decode instance's own answer to the same request without `pd`
(prefilled locally: the colocated computation), and both pools are whole afterwards."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from tests.router.test_router_real import DISAGG_READY, PD_ROUTE, start_router, stop

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

KEY = "router-api-key"
PROMPT = "The three primary colours are"
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def wait_for_engine_stats(url: str, timeout_s: float = 30.0) -> None:
    """Until the instance's /load carries its engine's stats (num_steps, which the tests read before sending
    anything): the engine sends its first ones up to a second after the ready line. (Started one after the other,
    the prefill instance always had that second; started together, it may not.)"""
    deadline = time.monotonic() + timeout_s
    while "num_steps" not in get_json(url + "/load"):
        assert time.monotonic() < deadline, f"{url}/load has no engine stats after {timeout_s:g} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def deployment(real_instances):
    """A prefill and a decode instance of the router package's (tests/router/conftest.py: started at once, model
    loading dominates) behind this module's router."""
    if not DISAGG_READY:
        pytest.skip("pdserve.disagg is not available")
    procs = []
    try:
        started = real_instances.get("p0", "d0")
        p, d = started["p0"], started["d0"]
        for url in (p[1], d[1]):
            wait_for_engine_stats(url)
        status = 0
        try:
            urllib.request.urlopen(urllib.request.Request(p[1] + PD_ROUTE, data=b"{}", method="POST"), timeout=10)
        except urllib.error.HTTPError as e:
            status = e.code
        if status == 404:
            pytest.skip("the instances do not serve the PD routes")
        r = start_router("--prefill", p[1], "--decode", d[1], "--api-key", KEY)
        procs.append(r[0])
        yield {"prefill": p[1], "decode": d[1], "router": r[1]}
    finally:
        for proc in procs:
            stop(proc)


@pytest.fixture(scope="module")
def via_router(deployment):
    return openai.OpenAI(base_url=deployment["router"] + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def direct(deployment):
    """The decode instance itself (no `pd`: it prefills locally)."""
    return openai.OpenAI(base_url=deployment["decode"] + "/v1", api_key="unused", max_retries=0, timeout=300)


def prefill_steps(deployment) -> int:
    return get_json(deployment["prefill"] + "/load")["num_steps"]


def pools_whole(deployment, timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [get_json(deployment[k] + "/load") for k in ("prefill", "decode")]
        if all(ld["num_running"] == 0 and ld["num_waiting"] == 0 and ld.get("num_remote", 0) == 0
               and ld["num_free_blocks"] == ld["num_total_blocks"]
               and not (ld.get("pd") or {}).get("quarantine_blocks") for ld in loads):
            return
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


def texts(r) -> list[str]:
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_router_api_key(deployment, via_router):
    bad = openai.OpenAI(base_url=deployment["router"] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="x", max_tokens=1)
    root = openai.OpenAI(base_url=deployment["router"], api_key=KEY, max_retries=0)
    tok = root.post("/tokenize", body={"prompt": PROMPT}, cast_to=object)
    assert root.post("/detokenize", body={"tokens": tok["tokens"]}, cast_to=object)["prompt"].endswith(PROMPT)


def test_n_with_a_seed_through_pd_equals_local(deployment, via_router, direct):
    model = via_router.models.list().data[0].id
    args = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, n=4, seed=42,
                extra_body={"ignore_eos": True})
    before = prefill_steps(deployment)
    pd = via_router.completions.create(**args)
    assert prefill_steps(deployment) > before, "nothing was prefilled remotely"
    local = direct.completions.create(**args)
    assert texts(pd) == texts(local) and len(set(texts(pd))) == 4
    assert pd.usage.completion_tokens == local.usage.completion_tokens == 24
    pools_whole(deployment)


def test_batch_prompts_and_streams_through_pd_equal_local(deployment, via_router, direct):
    model = via_router.models.list().data[0].id
    args = dict(model=model, prompt=PROMPTS, max_tokens=5, temperature=0)
    pd, local = via_router.completions.create(**args), direct.completions.create(**args)
    assert texts(pd) == texts(local) and [c.index for c in pd.choices] == [0, 1, 2]
    assert pd.usage.prompt_tokens == local.usage.prompt_tokens
    stream = via_router.completions.create(stream=True, n=2, seed=5, **{**args, "temperature": 0.7})
    got = {i: "" for i in range(6)}
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.text
    assert list(got.values()) == texts(direct.completions.create(n=2, seed=5, **{**args, "temperature": 0.7}))
    chat_args = dict(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4, n=2,
                     seed=11)
    chat_pd, chat_local = via_router.chat.completions.create(**chat_args), direct.chat.completions.create(**chat_args)
    assert [c.message.content for c in chat_pd.choices] == [c.message.content for c in chat_local.choices]
    pools_whole(deployment)


def test_penalties_and_logit_bias_through_pd_equal_local(deployment, via_router, direct):
    model = via_router.models.list().data[0].id
    cases = [
        dict(presence_penalty=1.2, frequency_penalty=0.7),
        dict(extra_body={"repetition_penalty": 1.8, "ignore_eos": True}),
        dict(logit_bias={"1": -100, "506": 5}),
        dict(temperature=1.0, seed=8, frequency_penalty=-1.0, extra_body={"min_tokens": 4}),
    ]
    for extra in cases:
        args = {"model": model, "prompt": "one one one one one", "max_tokens": 6, "temperature": 0, **extra}
        assert texts(via_router.completions.create(**args)) == texts(direct.completions.create(**args)), extra
    pools_whole(deployment)


def test_client_disconnect_through_pd_frees_every_choice(deployment):
    import aiohttp

    async def go() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            body = {"prompt": PROMPT * 4, "max_tokens": 200, "n": 3, "temperature": 1.0, "stream": True}
            r = await s.post(deployment["router"] + "/v1/completions", json=body)
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            r.close()

    asyncio.run(go())
    pools_whole(deployment)

"""Fuzz the router (in front of a real colocated instance, default model on CPU) with 600 malformed requests while
eight greedy streams run through it: no 5xx, no hang, every error OpenAI's JSON, the streams' outputs equal an
undisturbed run, and the instance's KV pool is whole afterwards. The router runs with an API key: the fuzz sends
it, so the malformed bodies reach the router's own checks (and a few requests go without it)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.router.test_router_real import start_router, stop
from tests.server.fuzz import Case, fuzz_during, generate_cases
from tests.server.test_fuzz import STREAM_PROMPTS

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

MAX_REQUEST_BYTES = 256 * 1024
NUM_CASES = 600
KEY = "router-fuzz-key"


@pytest.fixture(scope="module")
def deployment(real_instances):
    """The router package's colocated instance (tests/router/conftest.py) behind this module's router."""
    _, url = real_instances.get("ref")["ref"]
    router = start_router("--both", url, "--api-key", KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                          "--body-read-timeout", "2")
    try:
        yield url, router[1]
    finally:
        stop(router[0])


async def greedy_stream(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


async def streams(url: str) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     headers={"Authorization": f"Bearer {KEY}"}) as s:
        return list(await asyncio.gather(*(greedy_stream(s, url, p) for p in STREAM_PROMPTS)))


def test_router_fuzz_spares_concurrent_streams(deployment):
    instance, router = deployment
    undisturbed = asyncio.run(streams(router))
    cases = generate_cases(seed=2, n=NUM_CASES, max_request_bytes=MAX_REQUEST_BYTES)
    cases += [Case("POST", "/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer wrong"}, label="key"),
              Case("POST", "/tokenize", b'{"prompt": "x"}', {"Authorization": "Basic x"}, label="key")]

    async def go() -> tuple[list[list[str]], dict[int, int], float]:
        return await fuzz_during(lambda: streams(router), router, cases, concurrency=32, headers={"Authorization": f"Bearer {KEY}"})

    rounds, statuses, took = asyncio.run(go())
    assert all(r == undisturbed for r in rounds), (undisturbed, rounds)
    assert sum(statuses.values()) == len(cases)
    assert {400, 401, 404, 405, 408, 413, 415} <= set(statuses), statuses
    assert took < 60, f"{len(cases)} malformed requests took {took:.0f} s"

    async def pool_whole() -> None:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(instance + "/load") as r:
                    load = await r.json()
                if not (load["num_running"] or load["num_waiting"]) and \
                        load["num_free_blocks"] == load["num_total_blocks"]:
                    return
                assert time.monotonic() < deadline, load
                await asyncio.sleep(0.2)

    asyncio.run(pool_whole())

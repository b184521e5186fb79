"""The router's access control and error shapes (fake instances): its API keys, the key it forwards, signed pd
orders and aborts, strict bodies, OpenAI-shaped errors, /tokenize forwarding and shedding when every instance is
over its latency budget."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from pdserve.router.config import RouterConfig
from tests.router.router_harness import Deployment, run, wait_until

pytestmark = pytest.mark.timeout(60)

LONG = "word " * 100  # long enough to be disaggregated


async def error_of(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json(content_type=None)
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


def test_api_keys_at_the_router_and_the_key_sent_to_instances():
    async def main():
        async with Deployment(decode=1, api_keys=["client-key"], instance_api_key="inst-key") as d:
            for headers in ({}, {"Authorization": "Bearer nope"}):
                async with d.client.post(d.url + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
                    assert (await error_of(r, 401))["code"] == "invalid_api_key"
                async with d.client.post(d.url + "/tokenize", json={"prompt": "x"}, headers=headers) as r:
                    await error_of(r, 401)
            ok = {"Authorization": "Bearer client-key"}
            async with d.client.post(d.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                     headers=ok) as r:
                assert r.status == 200
            assert d.decode[0].authorization == ["Bearer inst-key"]
            for path in ("/health", "/metrics"):
                async with d.client.get(d.url + path) as r:
                    assert r.status == 200

    run(main())


def test_the_instance_key_defaults_to_the_routers_own():
    assert RouterConfig(decode=["h:1"], api_keys=["a", "b"]).upstream_api_key == "a"
    assert RouterConfig(decode=["h:1"]).upstream_api_key is None
    with pytest.raises(ValueError, match="at least 16 are needed"):
        RouterConfig(decode=["h:1"], deployment_secret="short")


def test_pd_orders_and_aborts_are_signed():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0) as d:
            status, _, body = await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 3, "n": 2,
                                                               "temperature": 1})
            assert status == 200, body  # the fake decode instance verified the signature
            assert d.decode[0].requests[0]["pd"]["prefill_urls"] == [d.prefill[0].url]
            assert d.decode[0].requests[0]["n"] == 2  # n and the prompt list pass through unchanged
            d.decode[0].behavior.first_delay_s = 5.0
            task = asyncio.ensure_future(d.client.post(d.url + "/v1/completions",
                                                       json={"prompt": LONG, "stream": True}))
            await wait_until(lambda: d.decode[0].active == 1)
            task.cancel()
            await wait_until(lambda: d.decode[0].aborts and d.prefill[0].aborts, timeout=5)

    run(main())


def test_without_a_secret_the_router_never_disaggregates():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0, deployment_secret=None) as d:
            status, _, body = await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 2})
            assert status == 200, body
            assert "pd" not in d.decode[0].requests[0]
            assert 'reason="no_secret"' in await d.metrics()

    run(main())


def test_bodies_and_errors_are_checked_and_shaped():
    async def main():
        async with Deployment(decode=1, max_request_bytes=2048) as d:
            post = d.url + "/v1/completions"
            cases = [
                (b'{"prompt": "x", "temperature": NaN}', {}, 400),
                (b"[" * 1000 + b"]" * 1000, {}, 400),
                (b'{"prompt": "\\udc00"}', {}, 400),
                (b'{"prompt": "\xfe"}', {}, 400),
                (b'{"prompt": "x"', {}, 400),
                (b'{"prompt": "x", "pd": {}}', {}, 400),
                (json.dumps({"prompt": "x" * 3000}).encode(), {}, 413),
                (gzip.compress(json.dumps({"prompt": "y" * 3000}).encode()), {"Content-Encoding": "gzip"}, 413),
                (b'{"prompt": "x"}', {"Content-Encoding": "zstd"}, 415),
                (b'{"prompt": "x"}', {"Content-Encoding": "gzip"}, 400),
            ]
            for raw, headers, status in cases:
                async with d.client.post(post, data=raw, headers=headers) as r:
                    await error_of(r, status)
            async with d.client.post(post, data=gzip.compress(b'{"prompt": "x", "max_tokens": 1}'),
                                     headers={"Content-Encoding": "gzip"}) as r:
                assert r.status == 200
            async with d.client.get(d.url + "/v1/nothing") as r:
                await error_of(r, 404)
            async with d.client.get(post) as r:
                await error_of(r, 405)
            assert not d.decode[0].requests[1:]  # only the valid one reached the instance

    run(main())


def test_tokenize_and_detokenize_are_forwarded_to_a_healthy_instance():
    async def main():
        async with Deployment(prefill=1, decode=1) as d:
            async with d.client.post(d.url + "/tokenize", json={"prompt": "hé"}) as r:
                assert r.status == 200 and (await r.json())["tokens"] == [104, 233]
            async with d.client.post(d.url + "/detokenize", json={"tokens": [104, 233]}) as r:
                assert (await r.json()) == {"prompt": "hé"}
            assert d.decode[0].paths == ["/tokenize", "/detokenize"] and not d.prefill[0].paths
            async with d.client.post(d.url + "/tokenize", data=b"{bad") as r:
                await error_of(r, 400)
            async with d.client.get(d.url + "/tokenize") as r:
                await error_of(r, 405)

    run(main())


def test_every_instance_over_budget_sheds_at_once_with_retry_after():
    async def main():
        async with Deployment(decode=2) as d:
            for fake in d.decode:
                fake.behavior.load = {"queue_wait_s": 12.0, "max_queue_wait_s": 5.0}
            await asyncio.sleep(0.3)  # a poll round
            async with d.client.post(d.url + "/v1/completions", json={"prompt": "x"}) as r:
                err = await error_of(r, 503)
                assert "latency budget" in err["message"] and r.headers["Retry-After"] == "7"
            assert not any(f.requests for f in d.decode)
            d.decode[1].behavior.load = {"queue_wait_s": 1.0, "max_queue_wait_s": 5.0}
            await asyncio.sleep(0.3)
            status, _, _ = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert status == 200 and len(d.decode[1].requests) == 1 and not d.decode[0].requests

    run(main())


def test_an_instances_retry_after_reaches_the_client():
    async def main():
        async with Deployment(decode=2) as d:
            for fake, retry in zip(d.decode, ("4", "9")):
                fake.behavior.fail_status = 503
                fake.behavior.fail_headers = {"Retry-After": retry}
            async with d.client.post(d.url + "/v1/completions", json={"prompt": "x"}) as r:
                await error_of(r, 503)
                assert r.headers["Retry-After"] in ("4", "9")  # the last instance tried

    run(main())

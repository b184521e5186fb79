"""A real server with room for one running and one waiting request: the rest are shed with 503 + Retry-After."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.server.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-model-len", "256", "--max-num-seqs", "1", "--max-waiting", "1")
    yield s
    assert s.stop() == 0, s.output()


def test_full_queue_answers_503_with_retry_after(server):
    n = 6
    body = {"model": server.model, "prompt": "Count to ten:", "max_tokens": 16, "ignore_eos": True, "stream": True}

    async def one(s: aiohttp.ClientSession) -> tuple[int, dict, str]:
        async with s.post(server.url + "/v1/completions", json=body) as r:
            return r.status, dict(r.headers), await r.text()

    async def run() -> list:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            return await asyncio.gather(*(one(s) for _ in range(n)))

    results = asyncio.run(run())
    statuses = sorted(r[0] for r in results)
    assert set(statuses) == {200, 503}, statuses  # some served, the rest shed; none dropped or failed
    for status, headers, text in results:
        if status == 503:
            assert int(headers["Retry-After"]) >= 1
            assert '"code": "queue_full"' in text and "Traceback" not in text
        else:
            assert text.endswith("data: [DONE]\n\n")
    load = server.get_json("/load")
    assert load["num_running"] == 0 and load["num_waiting"] == 0

"""Overload is shed, never queued without bound: a real server with room for one running and one waiting request
sheds the rest with 503 + Retry-After; a server at three times its capacity serves every request it admits within
its latency budget (--max-queue-wait) and refuses the rest at once."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from tests.server.live_server import start_servers, stop_servers

pytestmark = pytest.mark.timeout(600)


BUDGET_S = 5.0  # --max-queue-wait, shortened from its default (30 s) so the test reaches overload within seconds


@pytest.fixture(scope="module")
def servers():
    """Both tests' instances, started at once (loading the model dominates): `server` has room for one running and
    one waiting request; `budget_server` a small batch so that three times its capacity is a modest request rate on
    two shared cores, and every other admission setting (--max-waiting 4096 included) at its default."""
    made = start_servers({
        "server": ("--max-model-len", "256", "--max-num-seqs", "1", "--max-waiting", "1"),
        "budget_server": ("--max-model-len", "256", "--max-num-seqs", "4", "--max-queue-wait", str(BUDGET_S)),
    })
    yield made
    codes = stop_servers(list(made.values()))
    for (name, s), code in zip(made.items(), codes):
        assert code == 0, (name, s.output())


@pytest.fixture(scope="module")
def server(servers):
    return servers["server"]


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


@pytest.fixture(scope="module")
def budget_server(servers):
    return servers["budget_server"]


async def _timed_stream(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed request: status, headers, time to first token, end-to-end time and how it ended."""
    t0 = time.monotonic()
    async with s.post(url + "/v1/completions", json=body) as r:
        out = {"status": r.status, "retry_after": r.headers.get("Retry-After"), "ttft": None}
        if r.status != 200:
            out["body"] = await r.text()
        else:
            raw = b""
            async for chunk in r.content.iter_any():
                if out["ttft"] is None and b'"text"' in chunk:
                    out["ttft"] = time.monotonic() - t0
                raw += chunk
            out["complete"] = raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
    out["e2e"] = time.monotonic() - t0
    return out


def test_three_times_capacity_is_served_within_budget_or_shed_at_once(budget_server):
    """The machine's speed is measured first (CPU time is shared), so the test holds on a slow or busy host: the
    capacity with a full batch, and the time to first token and end to end of requests that never queue. Then
    three times that capacity arrives for a while: every request completes, with its first token within the
    budget plus its own unqueued time to first token, or is refused with 503 + Retry-After promptly."""
    url = budget_server.url
    body = {"model": budget_server.model, "prompt": "Write a list of fruits:", "max_tokens": 8,
            "ignore_eos": True, "stream": True, "temperature": 0}

    async def run() -> tuple[float, dict, list[dict], list[dict]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as s:
            warm = await _timed_stream(s, url, body)
            assert warm["complete"]
            done: list[dict] = []
            t0 = time.monotonic()

            async def worker() -> None:  # a closed loop that keeps the batch (4) full and nothing queued
                while len(done) < 12:
                    done.append(await _timed_stream(s, url, body))

            await asyncio.gather(*(worker() for _ in range(4)))
            capacity = len(done) / (time.monotonic() - t0)
            service = max(d["e2e"] for d in done)
            interval = 1.0 / (3 * capacity)
            tasks = []
            start = time.monotonic()
            # 8 s at least: at three times the capacity the queue passes the budget's worth of waiting within ~3 s
            # (it grows by twice the capacity a second), so every kind of answer comes for several seconds after
            while time.monotonic() - start < max(8.0, 3 * service):
                tasks.append(asyncio.ensure_future(_timed_stream(s, url, body)))
                await asyncio.sleep(interval)
            return capacity, warm, done, list(await asyncio.gather(*tasks))

    capacity, warm, unqueued, results = asyncio.run(run())
    assert all(d["status"] == 200 and d["complete"] for d in unqueued), unqueued
    ttft0 = max(d["ttft"] for d in unqueued)
    e2e0 = max(d["e2e"] for d in unqueued)
    served = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 503]
    context = (f"capacity {capacity:.2f}/s, unqueued ttft {ttft0:.2f} s e2e {e2e0:.2f} s, "
               f"{len(served)} served, {len(shed)} shed")
    assert len(served) + len(shed) == len(results), [r for r in results if r["status"] not in (200, 503)]
    assert served and shed, context
    assert all(r["complete"] for r in served), "a served stream ended without [DONE] or with an error"
    # the allowance for a request's own prefill is twice the slowest measured (pdserve.server.admission); CPU time
    # is shared with other processes here, so bounds are in multiples of what the unqueued requests took
    allowance = 3 * ttft0
    slowest = max(r["ttft"] for r in served + unqueued + [warm])  # the warm-up's prefill may be in the server's window
    for r in shed:  # refused with a reason and a time to come back: at once, or when its start deadline passed
        assert int(r["retry_after"]) >= 1, r
        if '"code": "over_budget"' in r["body"]:
            assert r["e2e"] <= 2.0, (r, context)
        else:
            # shed at its start deadline, which the message states: the budget plus twice the slowest prefill the
            # server measured (each within a time to first token this client saw), so the bound follows the
            # server's measurements under this load, not only the unqueued requests' before it
            assert '"code": "queue_timeout"' in r["body"], r
            start, budget, own = (float(x) for x in re.search(
                r"within ([0-9.]+) s \(the server's ([0-9.]+) s budget plus ([0-9.]+) s", r["body"]).groups())
            assert budget == BUDGET_S and abs(start - budget - own) <= 0.011, r
            assert own <= 2 * slowest + 0.01, (r, context, slowest)
            assert r["e2e"] <= start + ttft0 + 1.0, (r, context)
    assert any('"over_budget"' in r["body"] for r in shed), context  # most are refused at arrival
    p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]  # noqa: E731
    assert p99([r["ttft"] for r in served]) <= BUDGET_S + allowance + 1.0, context
    assert p99([r["e2e"] for r in served]) <= BUDGET_S + allowance + 2 * e2e0, context
    load = budget_server.get_json("/load")
    assert load["num_running"] == 0 and load["num_waiting"] == 0 and load["num_pending"] == 0

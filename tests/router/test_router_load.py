"""500 requests with random client aborts through a 2P2D deployment of fakes: none is lost, nothing leaks."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from tests.router.router_harness import Deployment, metric_value, run, wait_until

N_REQUESTS = 500
CONCURRENCY = 64


def test_500_requests_with_random_aborts_lose_none():
    rng = random.Random(1234)

    async def one(d: Deployment, i: int) -> str:
        stream = rng.random() < 0.7
        abort_after = rng.uniform(0.0, 0.06) if rng.random() < 0.3 else None
        prompt = "shared system prompt " * rng.randint(0, 8) + f"question {i}"
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 12), "stream": stream}

        async def exchange() -> str:
            async with d.client.post(d.url + "/v1/completions", json=body) as resp:
                raw = await resp.read()
            if resp.status != 200:
                return "error"
            if not stream:
                return "ok" if b'"choices"' in raw else "error"
            text = raw.decode()
            if not text.endswith("data: [DONE]\n\n"):
                return "silent"  # the one outcome that must never happen
            return "error" if '"error"' in text else "ok"

        task = asyncio.ensure_future(exchange())
        if abort_after is None:
            return await task
        done, _ = await asyncio.wait({task}, timeout=abort_after)
        if done:
            return task.result()
        task.cancel()  # the client goes away: the connection is closed mid-request
        try:
            await task
        except asyncio.CancelledError:
            pass
        return "aborted"

    async def main() -> None:
        async with Deployment(prefill=2, decode=2, local_prefill_max_tokens=8, max_inflight_per_instance=24,
                              max_queue=N_REQUESTS) as d:
            for fake in d.decode:
                fake.behavior.token_delay_s = 0.004
                fake.behavior.first_delay_s = 0.002
            sem = asyncio.Semaphore(CONCURRENCY)

            async def bounded(i: int) -> str:
                async with sem:
                    return await one(d, i)

            outcomes = await asyncio.gather(*(bounded(i) for i in range(N_REQUESTS)))
            counts = {k: outcomes.count(k) for k in set(outcomes)}
            assert sum(counts.values()) == N_REQUESTS
            assert counts.get("silent", 0) == 0, counts
            assert counts.get("error", 0) == 0, counts  # healthy fakes: nothing should fail
            assert counts.get("ok", 0) > N_REQUESTS // 2, counts
            # every accepted request is accounted for, and nothing is left in flight anywhere
            await wait_until(lambda: all(f.active == 0 for fs in d.fakes.values() for f in fs), timeout=5)
            await wait_until(lambda: all(i.inflight == 0 for i in d.router.pools), timeout=5)
            assert d.router.admission.queued == 0
            text = await d.metrics()
            ok = sum(metric_value(text, "pdserve:router_requests_total", f'mode="{m}",outcome="ok"')
                     for m in ("pd", "local"))
            aborted = sum(metric_value(text, "pdserve:router_requests_total", f'mode="{m}",outcome="client_abort"')
                          for m in ("pd", "local"))
            received = sum(len(f.requests) for f in d.decode)
            # the router finished every request it forwarded as ok or as a client abort (a client may also leave
            # before its request reached a decode instance, or after the router finished it)
            assert received <= ok + aborted <= N_REQUESTS, (ok, aborted, received, counts)
            assert ok >= counts["ok"]
            # aborted requests that reached a decode instance were closed upstream, not left running
            decode_done = sum(f.completed + f.disconnects for f in d.decode)
            assert decode_done == received
            async with d.client.get(d.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                assert resp.status == 200

    run(main(), timeout=120)

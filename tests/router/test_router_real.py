"""The router in front of real instances (default model, CPU, tcp transport).

Greedy outputs through the router (colocated, 1P1D, 2P2D) must equal the colocated instance's token for token,
streaming and not, including prompts whose prefix the decode instance already caches; client aborts mid-stream
and mid-handover must leave every KV pool whole; a killed decode instance gives its client an error and later
requests go to the survivor; a killed prefill instance leads to retry or local prefill, not failures.

The instances are the router package's (tests/router/conftest.py: started once, shared with test_router_api_live and
test_router_fuzz, which run before this module; model loading dominates the cost); the routers are this module's.
The kill tests come last in the file because they take instances down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from tests.router.router_harness import wait_line
from tests.server.live_server import SECRET

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DISAGG_READY = importlib.util.find_spec("pdserve.disagg.export_side") is not None
PD_ROUTE = "/internal/pd/prefill"  # served by instances that run the handover (pdserve.disagg.routes)
MAX_TOKENS = 6  # as test_pd_transports: the first token from the prefill side, five decoded over the handed-over KV
SYSTEM = "You are a careful assistant. Answer briefly and precisely, and never invent facts. " * 3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    SYSTEM + "Question: what is the boiling point of water at sea level?",
    SYSTEM + "Question: name the largest planet of the solar system.",  # shares the long prefix (cache hit)
    SYSTEM + "Question: what is the boiling point of water at sea level?",  # exact repeat
]
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello in French."}]
ROUTER_FLAGS = ["--local-prefill-max-tokens", "0", "--health-timeout", "5", "--breaker-failures", "5",
                "--health-interval", "0.2"]


def _start(cmd: list[str], pattern: str, timeout: float) -> tuple[subprocess.Popen, str]:
    # one deployment secret for the routers and the instances: the routers sign their pd orders with it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PDSERVE_DEPLOYMENT_SECRET": SECRET}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def reader() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    seen: list[str] = []
    try:
        return proc, wait_line(lines, pattern, timeout, seen).group(1)
    except AssertionError:
        proc.kill()
        raise RuntimeError(f"{cmd} did not start:\n{''.join(seen[-30:])}") from None


def start_instance(role: str, *extra: str) -> tuple[subprocess.Popen, str]:
    # PDSERVE_TEST_INSTANCE_CMD: run these tests against another instance command (e.g. a wrapper under test)
    base = os.environ.get("PDSERVE_TEST_INSTANCE_CMD", f"{sys.executable} -m pdserve.server").split()
    cmd = [*base, "--role", role, "--port", "0", "--cpu-kv-cache-gb", "0.25", "--log-level", "warning", *extra]
    return _start(cmd, r"serving .* on (http://\S+)", timeout=300)


def start_router(*flags: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pdserve.router", "--port", "0", *ROUTER_FLAGS, *flags]
    return _start(cmd, r"serving on (http://\S+)", timeout=60)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Cluster:
    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.own: list[subprocess.Popen] = []  # what close() stops: the routers (the instances are the package's)
        self.pd_wired = False

    def require_pd(self) -> None:
        if not self.pd_wired:
            pytest.skip("the instances do not serve the PD routes yet (pdserve.disagg not wired into the server)")

    def add(self, name: str, started: tuple[subprocess.Popen, str], own: bool = False) -> None:
        self.procs[name], self.urls[name] = started
        if own:
            self.own.append(started[0])

    def close(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.own))) as pool:  # all at once
            list(pool.map(stop, self.own))


@pytest.fixture(scope="module")
def cluster(real_instances):
    c = Cluster()
    try:
        names = ["ref", *(("p0", "p1", "d0", "d1") if DISAGG_READY else ())]
        for name, started in real_instances.get(*names).items():
            c.add(name, started)
        if DISAGG_READY:
            c.pd_wired = run(_serves_pd_route(c.urls["p0"]))
        routers = {"r_colo": ("--both", c.urls["ref"])}
        if c.pd_wired:
            routers["r_1p1d"] = ("--prefill", c.urls["p0"], "--decode", c.urls["d0"])
            routers["r_2p2d"] = ("--prefill", c.urls["p0"], c.urls["p1"], "--decode", c.urls["d0"], c.urls["d1"],
                                 "--decode-policy", "round_robin")
        with concurrent.futures.ThreadPoolExecutor(len(routers)) as pool:  # the routers start in parallel
            futs = {name: pool.submit(start_router, *flags) for name, flags in routers.items()}
            concurrent.futures.wait(futs.values())
        for name, fut in futs.items():  # every started one is added (and stopped by close) before any error
            if fut.exception() is None:
                c.add(name, fut.result(), own=True)
        for fut in futs.values():
            fut.result()
        yield c
    finally:
        c.close()


def run(coro, timeout: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _serves_pd_route(url: str) -> bool:
    """A prefill instance running the handover rejects an empty prefill order (4xx other than 404)."""
    async with aiohttp.ClientSession() as s, s.post(url + PD_ROUTE, json={}) as resp:
        return resp.status != 404


async def complete(session: aiohttp.ClientSession, url: str, prompt: str | None = None, *, stream: bool,
                   messages: list | None = None) -> str:
    """Greedy completion (or chat) text via `url`; streaming requests are reassembled from their chunks."""
    path = "/v1/chat/completions" if messages is not None else "/v1/completions"
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    body.update({"messages": messages} if messages is not None else {"prompt": prompt})
    async with session.post(url + path, json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if messages is not None else choice["text"]
    text = ""
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for payload in events[:-1]:
        obj = json.loads(payload)
        assert "error" not in obj, obj
        assert "pd_timings" not in obj
        for choice in obj["choices"]:
            text += (choice["delta"].get("content") or "") if messages is not None else choice["text"]
    return text


async def load(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/load") as resp:
        return await resp.json()


async def abort_before_first_token(session: aiohttp.ClientSession, url: str, prompt: str, delays: tuple[float, ...],
                                   max_tokens: int) -> None:
    """One streamed request per delay, dropped by the client after it (before any token: the order or the push in
    flight); each prompt starts with its delay, so no two share a prefix."""
    for delay in delays:
        try:
            await session.post(url + "/v1/completions", json={"prompt": f"{delay} " + prompt, "max_tokens": max_tokens,
                                                              "stream": True},
                               timeout=aiohttp.ClientTimeout(total=delay + 0.001))
        except asyncio.TimeoutError:
            pass


async def assert_pools_whole(session: aiohttp.ClientSession, urls: list[str], timeout: float = 15.0) -> None:
    """Every instance idle with all KV blocks free (cached blocks nobody holds count as free)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [await load(session, u) for u in urls]
        whole = [ld["num_free_blocks"] == ld["num_total_blocks"] and ld["num_running"] == 0
                 and ld["num_waiting"] == 0 and ld.get("num_remote", 0) == 0 for ld in loads]
        if all(whole):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not whole: {dict(zip(urls, loads))}")
        await asyncio.sleep(0.2)


async def _references(cluster: Cluster) -> dict:
    async with aiohttp.ClientSession() as s:
        ref = cluster.urls["ref"]
        out = {p: await complete(s, ref, p, stream=False) for p in PROMPTS}
        out["chat"] = await complete(s, ref, messages=CHAT, stream=False)
    return out


@pytest.fixture(scope="module")
def expected(cluster) -> dict:
    """The colocated instance's greedy answers, asked directly (no router)."""
    return run(_references(cluster))


def test_colocated_through_router_matches_the_instance(cluster, expected):
    async def main():
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                for p in PROMPTS[1:4]:
                    assert await complete(s, cluster.urls["r_colo"], p, stream=stream) == expected[p]
                assert await complete(s, cluster.urls["r_colo"], messages=CHAT, stream=stream) == expected["chat"]
            await assert_pools_whole(s, [cluster.urls["ref"]])

    run(main())


@pytest.mark.parametrize("router", ["r_1p1d", "r_2p2d"])
def test_disaggregated_outputs_equal_colocated(cluster, expected, router):
    cluster.require_pd()

    async def main():
        async with aiohttp.ClientSession() as s:
            prefill = [cluster.urls[n] for n in ("p0", "p1")]
            steps_before = sum([(await load(s, u))["num_steps"] for u in prefill])
            for stream in (False, True):
                for p in PROMPTS:
                    assert await complete(s, cluster.urls[router], p, stream=stream) == expected[p], (p, stream)
                assert await complete(s, cluster.urls[router], messages=CHAT, stream=stream) == expected["chat"]
            steps_after = sum([(await load(s, u))["num_steps"] for u in prefill])
            assert steps_after > steps_before, "no prefill instance did any work: nothing was disaggregated"
            async with s.get(cluster.urls[router] + "/metrics") as resp:
                assert 'pdserve:router_requests_total{mode="pd",outcome="ok"}' in await resp.text()
            await assert_pools_whole(s, [cluster.urls[n] for n in ("p0", "p1", "d0", "d1")])

    run(main())


def test_aborts_mid_stream_and_mid_handover_leave_pools_whole(cluster, expected):
    cluster.require_pd()

    async def main():
        url = cluster.urls["r_2p2d"]
        long_prompt = SYSTEM * 4 + "Tell me a long story about a lighthouse keeper."
        async with aiohttp.ClientSession() as s:
            for i in range(4):  # mid-stream: after the first chunk
                resp = await s.post(url + "/v1/completions", json={"prompt": f"{i} " + long_prompt,
                                                                   "max_tokens": 200, "stream": True})
                await resp.content.readuntil(b"\n\n")
                resp.close()
            await abort_before_first_token(s, url, long_prompt, (0.0, 0.02, 0.05, 0.1, 0.2), 50)  # mid-handover
            await assert_pools_whole(s, [cluster.urls[n] for n in ("p0", "p1", "d0", "d1")], timeout=30)
            # and the deployment still answers correctly
            assert await complete(s, url, PROMPTS[2], stream=True) == expected[PROMPTS[2]]

    run(main())


def test_router_phase_metrics_come_from_the_decode_instance(cluster, expected):
    """pd_timings reported by the decode instance feed the router's per-phase histograms (and never reach clients)."""
    cluster.require_pd()

    async def go():
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                assert await complete(s, cluster.urls["r_1p1d"], PROMPTS[0], stream=stream) == expected[PROMPTS[0]]
            async with s.get(cluster.urls["r_1p1d"] + "/metrics") as resp:
                return await resp.text()

    text = run(go())
    for phase in ("queue", "prefill", "handover", "first_token"):
        pattern = 'pdserve:router_phase_seconds_count{mode="pd",phase="' + phase + '"} '
        m = re.search(re.escape(pattern) + r"(\S+)", text)
        assert m and float(m.group(1)) >= 2, (phase, text[:2000])


async def _one_of_many(session: aiohttp.ClientSession, url: str, i: int, rng) -> str:
    """One streamed request that the client may abandon at a random point; returns how it ended."""
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven"]
    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 24)))
    abort_after = rng.choice([None, None, 0, 1, 2])  # chunks to read before walking away (0: mid-handover)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=120)) as resp:
            if resp.status != 200:
                await resp.read()
                return f"http_{resp.status}"
            n = 0
            async for line in resp.content:
                if abort_after is not None and n >= abort_after:
                    return "aborted"  # leaving the context manager closes the connection
                if line.startswith(b"data: "):
                    if line.strip() == b"data: [DONE]":
                        return "completed"
                    if b'"error"' in line:
                        return "error_event"
                    n += 1
            return "cut_without_done"
    except asyncio.TimeoutError:
        return "timeout"


def test_500_requests_with_random_aborts_lose_none_and_leak_nothing(cluster):
    """Through 2P2D: every request completes, errors visibly, or was abandoned by its client; none hangs or
    vanishes, and afterwards every KV pool is whole (no block held, reserved or quarantined)."""
    cluster.require_pd()
    import random

    async def go():
        rng = random.Random(5)
        # 64 in flight: the instances batch more of them per step (on 2 CPU cores 500 take ~40 s instead of ~60 s
        # at 32), and more aborts overlap
        sem = asyncio.Semaphore(64)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def guarded(i):
                async with sem:
                    return await _one_of_many(s, cluster.urls["r_2p2d"], i, rng)

            outcomes = await asyncio.gather(*(guarded(i) for i in range(500)))
            urls = [cluster.urls[k] for k in ("p0", "p1", "d0", "d1")]
            await assert_pools_whole(s, urls, timeout=60)
            for u in urls:
                pd = (await load(s, u)).get("pd") or {}
                assert not pd.get("quarantine_blocks"), (u, pd)
        return outcomes

    outcomes = run(go(), timeout=900)
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    assert len(outcomes) == 500
    assert set(counts) <= {"completed", "aborted"}, counts  # nothing lost, nothing cut, nothing timed out
    assert counts.get("completed", 0) > 200 and counts.get("aborted", 0) > 100, counts


def test_killed_decode_errors_promptly_and_survivor_serves(cluster, expected):
    cluster.require_pd()

    async def main():
        url = cluster.urls["r_2p2d"]
        # 30 tokens: both streams are still running at the kill, which comes after their first chunk (~3 s of
        # tokens are left on a 2-core CPU)
        body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s:
            # two streams at once: the router's round robin puts one on each decode instance
            streams = [await s.post(url + "/v1/completions", json=body) for _ in range(2)]
            for resp in streams:
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")
            cluster.procs["d1"].kill()
            t0 = time.monotonic()

            async def rest(resp: aiohttp.ClientResponse) -> tuple[str, float]:
                return (await resp.read()).decode(), time.monotonic() - t0

            results = sorted(await asyncio.gather(*(rest(r) for r in streams)), key=lambda r: '"upstream_error"' in r[0])
            (ok_text, _), (err_text, err_after) = results
            assert '"upstream_error"' in err_text and '"upstream_error"' not in ok_text, results
            assert err_after < 3.0  # promptly, not at a read timeout
            assert ok_text.endswith("data: [DONE]\n\n") and err_text.endswith("data: [DONE]\n\n")
            for p in PROMPTS:  # later requests all go to the survivor
                assert await complete(s, url, p, stream=True) == expected[p]

    run(main())


def test_killed_prefill_leads_to_retry_or_local_prefill(cluster, expected):
    cluster.require_pd()

    async def main():
        url = cluster.urls["r_2p2d"]
        cluster.procs["p0"].kill()
        async with aiohttp.ClientSession() as s:
            for i, p in enumerate(PROMPTS):  # right after the kill: the router may still name p0 first
                assert await complete(s, url, f"{i} " + p, stream=bool(i % 2)) is not None
            for p in PROMPTS:
                assert await complete(s, url, p, stream=False) == expected[p]
            # a reservation whose prefill peer died mid-order is quarantined until its lease (10 s: the instances'
            # --kv-lease, tests/router/conftest.py) runs out
            await assert_pools_whole(s, [cluster.urls[n] for n in ("p1", "d0")], timeout=45)

    run(main())

"""Prefill/decode handover over the opt-in transports, end to end: a router in front of real instances (default
model, CPU) whose KV moves over Mooncake (protocol tcp) or over nccl (Gloo on host memory).

Per transport: 1P1D and 2P2D give the colocated answer token for token, streaming and not (one prefill instance
pushes layer by layer, the other pushes each chunk's blocks ahead of the prompt's end, so every push shape runs over
each transport); the transport each handover took shows in the
instances' /metrics (per peer) and the router's; aborts mid-handover and a prefill instance killed mid-handover leave
every pool whole. Across transports: a prefill instance on tcp ordered by a decode instance on either is refused
before it computes anything, with an error naming both transports, and the decode instance recomputes
(`--kv-fallback recompute`: the colocated answer) or fails the request with an OpenAI error (`fail`), never hangs.

One deployment per transport, module-scoped (its instances start once, in parallel: model loading dominates);
the kill test comes last. Mooncake's tests skip, saying why, where its transfer engine cannot be loaded (as the
transport's own tests do: tests/kv/test_kv_optin.py). Tensor parallelism over these transports (one agent per rank):
tests/disagg/test_pd_tp.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.kv.test_kv_optin import MOONCAKE
from tests.router.test_router_real import (
    _start,
    abort_before_first_token,
    assert_pools_whole,
    load,
    run,
    start_router,
    stop,
)
from tests.server.live_server import pd_headers, start_in_parallel

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 2
PROMPTS = [
    "The capital of France is",
    SYSTEM + "Question: what is the boiling point of water at sea level?",
    SYSTEM + "Question: name the largest planet of the solar system.",  # shares the prefix (cache hit on decode)
]
# instance flags per transport; every decode instance holds blocks for a dead peer at most 10 s
TRANSPORTS = {"mooncake": ("--kv-transport", "mooncake", "--kv-protocol", "tcp"), "nccl": ("--kv-transport", "nccl"),
              "tcp": ("--kv-transport", "tcp")}
COMMON = ("--port", "0", "--device", "cpu", "--cpu-kv-cache-gb", "0.1", "--max-model-len", "512", "--log-level",
          "warning", "--kv-lease", "10")


def start_instance(role: str, transport: str, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pdserve.server", "--role", role, *COMMON, *TRANSPORTS[transport], *extra]
    return _start(cmd, r"serving .* on (http://\S+)", timeout=400)


def start_all(start, specs: dict[str, tuple]) -> dict[str, tuple[subprocess.Popen, str]]:
    """start(*spec) for every spec at once; if any fails, the others are stopped."""
    return start_in_parallel(start, specs, lambda started: stop(started[0]))


class Deployment:
    """One transport's instances (p0, p1 push to d0, d1) and routers, all processes."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}

    def url(self, name: str) -> str:
        return self.urls[name]

    def instances(self) -> list[str]:
        """The deployment's live prefill and decode instances of its transport."""
        return [self.urls[n] for n in ("p0", "p1", "d0", "d1") if self.procs[n].poll() is None]

    def close(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.procs))) as pool:
            list(pool.map(stop, self.procs.values()))


@pytest.fixture(scope="module")
def tcp_prefill():
    """The prefill instance on tcp that the mismatch test's decode instances order: the same for every transport,
    so it starts once (with the first deployment's instances) and serves both deployments. It never computes (every
    order it gets is refused), so nothing a deployment did to it can change what the next one sees."""
    held: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        yield held
    finally:
        for proc, _ in held.values():
            stop(proc)


@pytest.fixture(scope="module", params=[pytest.param("mooncake", id="mooncake-tcp", marks=MOONCAKE),
                                        pytest.param("nccl", id="nccl-gloo")])
def deployment(request, tcp_prefill):
    """One transport at a time (an instance holds ~2 GB: two transports' worth at once thrash a small machine):
    p1 pushes layer by layer; p0 prefills in 16-token chunks, so the full blocks of a prompt's chunks before its last
    are pushed ahead (--kv-push-ahead, on by default) while the next chunk computes; d1 fails requests whose handover fails (d0 recomputes them); `tcp_p` is a prefill
    instance on tcp (the mismatch test; shared by the deployments: tcp_prefill). Routers: r1 = 1P1D (p1 -> d0),
    r4 = 1P1D (p0 -> d0), r2 = 2P2D, r3 = p0, p1 -> d0 (the kill test: a decode instance that recomputes what a
    dead prefill instance left)."""
    t = request.param
    d = Deployment(t)
    specs = {"p0": ("prefill", t, "--max-num-batched-tokens", "16"), "p1": ("prefill", t, "--kv-layerwise", "on"),
             "d0": ("decode", t),
             "d1": ("decode", t, "--kv-fallback", "fail")}
    if "tcp_p" not in tcp_prefill:
        specs["tcp_p"] = ("prefill", "tcp")
    try:
        for name, started in start_all(start_instance, specs).items():
            if name == "tcp_p":
                tcp_prefill[name] = started
            else:
                d.procs[name], d.urls[name] = started
        u = d.urls
        u["tcp_p"] = tcp_prefill["tcp_p"][1]
        routers = {
            "r1": ("--prefill", u["p1"], "--decode", u["d0"]),
            "r2": ("--prefill", u["p0"], u["p1"], "--decode", u["d0"], u["d1"], "--decode-policy", "round_robin"),
            "r3": ("--prefill", u["p0"], u["p1"], "--decode", u["d0"]),
            "r4": ("--prefill", u["p0"], "--decode", u["d0"]),  # 1P1D, chunked prefill
            # decode instances on the deployment's transport ordering a prefill instance on tcp
            "mis": ("--prefill", u["tcp_p"], "--decode", u["d0"]),
            "mis_fail": ("--prefill", u["tcp_p"], "--decode", u["d1"]),
        }
        for name, (proc, url) in start_all(start_router, routers).items():
            d.procs[name], u[name] = proc, url
        yield d
    finally:
        d.close()


def body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


async def complete(s: aiohttp.ClientSession, url: str, prompt: str, stream: bool) -> str:
    async with s.post(url + "/v1/completions", json=body(prompt, stream)) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    out = ""
    for payload in events[:-1]:
        obj = json.loads(payload)
        assert "error" not in obj and "pd_timings" not in obj, obj
        out += "".join(c["text"] for c in obj["choices"])
    return out


async def metrics(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as resp:
        return await resp.text()


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def expected(deployment) -> dict[str, str]:
    """Colocated answers: a decode instance asked without a `pd` field prefills locally."""
    async def main():
        async with aiohttp.ClientSession() as s:
            return {p: await complete(s, deployment.url("d1"), p, False) for p in PROMPTS}

    return run(main())


def test_1p1d_and_2p2d_equal_colocated_and_say_their_transport(deployment, expected):
    d, t = deployment, deployment.transport

    async def main():
        async with aiohttp.ClientSession() as s:
            for router in ("r4", "r1", "r2"):  # r4 first: d0's prefix cache holds none of the prompts yet
                for stream in (False, True):
                    for p in PROMPTS:
                        got = await complete(s, d.url(router), p, stream)
                        assert got == expected[p], (router, p, stream)
            await assert_pools_whole(s, d.instances())
            p0, p1, d0 = [await load(s, d.url(n)) for n in ("p0", "p1", "d0")]
            # 1P1D alone sent p1 six orders; all but the first (racing the connection) went layer by layer
            assert p1["pd"]["layerwise_exports"] >= 4 and p1["pd"]["export_failures"] == 0, p1["pd"]
            assert p0["pd"]["layerwise_exports"] == 0, p0["pd"]  # auto: whole pushes over mooncake and nccl
            # r4 alone sent p0 its first orders, the prompts in 16-token chunks: the two prompts longer than a chunk
            # pushed blocks ahead (later orders of the same prompts leave only their last block to move)
            assert p0["pd"]["ahead_exports"] >= 2 and p0["pd"]["export_failures"] == 0, p0["pd"]
            assert d0["pd"]["fallbacks"] == 0, d0["pd"]
            # which transport carried what, per peer: the prefill side counts pushes, the decode side arrivals
            dec = await metrics(s, d.url("d0"))
            pre = await metrics(s, d.url("p1"))
            assert counter(dec, "pdserve:kv_transfers_total", transport=t, outcome="ok") >= 6, dec
            assert counter(pre, "pdserve:kv_transfers_total", transport=t, outcome="ok") >= 6, pre
            assert counter(pre, "pdserve:kv_transfers_total", outcome="failed") == 0, pre
            peers = set(re.findall(r'pdserve:kv_transfers_total\{[^}]*peer="([^"]+)"', pre))
            assert peers and all(re.fullmatch(r"[\d.]+:\d+", p) for p in peers), pre  # decode agents' addresses
            for r in ("r1", "r2"):
                text = await metrics(s, d.url(r))
                assert counter(text, "pdserve:router_kv_transfers_total", transport=t) >= 2 * len(PROMPTS), text
                assert counter(text, "pdserve:router_prefill_fallback_total") == 0, text

    run(main())


def test_aborts_mid_handover_leave_pools_whole(deployment, expected):
    d = deployment
    url = d.url("r2")
    long_prompt = SYSTEM * 6 + "Tell me a long story about a lighthouse keeper."

    async def main():
        async with aiohttp.ClientSession() as s:
            await abort_before_first_token(s, url, long_prompt, (0.0, 0.05, 0.2, 0.5, 1.0), 20)
            resp = await s.post(url + "/v1/completions", json={"prompt": "x " + long_prompt, "max_tokens": 50,
                                                               "stream": True})
            await resp.content.readuntil(b"\n\n")  # mid-stream
            resp.close()
            await assert_pools_whole(s, d.instances(), timeout=40)
            for u in d.instances():
                assert not ((await load(s, u)).get("pd") or {}).get("quarantine_blocks"), u
            assert await complete(s, url, PROMPTS[1], True) == expected[PROMPTS[1]]

    run(main())


def test_mismatched_transports_fall_back_as_configured(deployment, expected):
    """Decode instances on the deployment's transport order a prefill instance on tcp: refused before any compute,
    with an error naming both transports; `--kv-fallback recompute` gives the colocated answer, `fail` an OpenAI error
    (streaming too), promptly."""
    d, t = deployment, deployment.transport

    async def main():
        async with aiohttp.ClientSession() as s:
            tcp_p = d.url("tcp_p")
            for stream in (False, True):
                assert await complete(s, d.url("mis"), PROMPTS[0], stream) == expected[PROMPTS[0]]
            # the decode instance's own account of the fallback (pd_timings, asked directly with a signed order)
            raw = json.dumps({**body(PROMPTS[0], False), "pd": {"prefill_urls": [tcp_p], "request_id": "m1"}}).encode()
            async with s.post(d.url("d0") + "/v1/completions", data=raw, headers=pd_headers(raw)) as r:
                out = await r.json()
            assert out["choices"][0]["text"] == expected[PROMPTS[0]]
            why = out["pd_timings"]["fallback_reason"]
            assert out["pd_timings"]["fallback"] == "local" and "KV transport mismatch" in why, why
            assert "tcp" in why and t in why and "400" in why, why
            assert (await load(s, tcp_p))["num_steps"] == 0, "the prefill instance computed a refused order"
            text = await metrics(s, d.url("mis"))
            assert counter(text, "pdserve:router_prefill_fallback_total", fallback="local") >= 2, text

            t0 = time.monotonic()
            async with s.post(d.url("mis_fail") + "/v1/completions", json=body(PROMPTS[0], False)) as r:
                err = await r.json()
                assert r.status >= 500, err
            assert "KV transport mismatch" in err["error"]["message"] and err["error"]["type"], err
            async with s.post(d.url("mis_fail") + "/v1/completions", json=body(PROMPTS[0], True)) as r:
                raw_stream = (await r.read()).decode()
            assert "KV transport mismatch" in raw_stream and raw_stream.endswith("data: [DONE]\n\n"), raw_stream
            assert time.monotonic() - t0 < 30  # promptly, never at a timeout
            await assert_pools_whole(s, [tcp_p, *d.instances()])

    run(main())


def test_killed_prefill_mid_handover_leaves_pools_whole(deployment, expected):
    """p0 dies while handovers are in flight: every request still gets the colocated answer (another prefill
    instance, or a local prefill where p0 may still have been writing), and the survivors' pools end whole."""
    d = deployment
    url = d.url("r3")

    async def main():
        async with aiohttp.ClientSession() as s:
            prompts = [f"{i} {p}" for i in range(2) for p in PROMPTS[:2]]
            want = {p: await complete(s, d.url("d1"), p, False) for p in prompts}  # local answers
            tasks = [asyncio.ensure_future(complete(s, url, p, bool(i % 2))) for i, p in enumerate(prompts)]
            await asyncio.sleep(0.5)
            d.procs["p0"].kill()
            got = await asyncio.gather(*tasks)
            assert got == [want[p] for p in prompts]
            for p in PROMPTS:  # and later requests too
                assert await complete(s, url, p, True) == expected[p]
            await assert_pools_whole(s, d.instances(), timeout=40)

    run(main())

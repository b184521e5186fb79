"""In-process deployments of fake instances behind a real router, for the router tests."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import time
from typing import Any

import aiohttp

from pdserve.router.config import RouterConfig
from pdserve.router.proxy import Router, bound_port, start_router
from tests.router.fake_instance import FakeInstance

SECRET = "router-tests-deployment-secret-0123"


def run(coro: Any, timeout: float = 60.0) -> Any:
    """Run a test coroutine with a hard deadline, so a bug shows up as a failure instead of a hang."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(predicate: Any, timeout: float = 3.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the timeout")
        await asyncio.sleep(interval)


def wait_line(lines: queue.Queue, pattern: str, timeout: float, seen: list[str]) -> re.Match:
    """The first line from a process's output queue (None = it ended) matching `pattern`, within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}; output so far:\n{''.join(seen)}")


class Deployment:
    """`async with Deployment(prefill=2, decode=2, **config) as d:` fakes + router + a client session."""

    def __init__(self, prefill: int = 0, decode: int = 1, both: int = 0, **overrides: Any) -> None:
        self.counts = {"prefill": prefill, "decode": decode, "both": both}
        self.overrides = {"health_interval_s": 0.05, "startup_wait_s": 2.0, "port": 0,
                          "deployment_secret": SECRET, **overrides}
        self.fakes: dict[str, list[FakeInstance]] = {}
        self.router: Router | None = None
        self.url = ""

    @property
    def prefill(self) -> list[FakeInstance]:
        return self.fakes["prefill"]

    @property
    def decode(self) -> list[FakeInstance]:
        return self.fakes["decode"]

    @property
    def both(self) -> list[FakeInstance]:
        return self.fakes["both"]

    async def __aenter__(self) -> Deployment:
        for role, n in self.counts.items():
            secret = self.overrides["deployment_secret"]
            self.fakes[role] = [FakeInstance(role, name=f"{role}{i}", secret=secret.encode() if secret else None)
                                for i in range(n)]
            for fake in self.fakes[role]:
                await fake.start()
        urls = {role: [f.url for f in fakes] for role, fakes in self.fakes.items()}
        config = RouterConfig(**urls, **self.overrides)
        self.router, self._runner = await start_router(config)
        self.url = f"http://127.0.0.1:{bound_port(self._runner)}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.close()
        await self._runner.cleanup()
        for fakes in self.fakes.values():
            for fake in fakes:
                await fake.stop()

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
        async with self.client.post(self.url + path, json=body) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)

    async def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST with stream=true; returns the parsed data events (the string "[DONE]" for the end marker)."""
        events: list[Any] = []
        async with self.client.post(self.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            raw = (await resp.read()).decode()
        for block in raw.split("\n\n"):
            if block.startswith("data: "):
                payload = block[6:]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    async def metrics(self) -> str:
        async with self.client.get(self.url + "/metrics") as resp:
            return await resp.text()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in Prometheus text output (0.0 if absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0

"""The decode driver's rule for prefill orders, against stub prefill instances: a candidate that answered (an error)
or was never reached gives way to the next; an order that was sent and got no answer (the connection dropped, or
it timed out) is never handed to another candidate, since that one may still be pushing into the reserved blocks:
the engine is told to recompute or fail with `peer_done=False` (the blocks wait out the lease in quarantine)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from pdserve.config import KVTransferConfig
from pdserve.disagg.driver import PREFILL_ROUTE, DecodeDriver
from pdserve.disagg.routes import parse_order, unpack_order
from pdserve.engine.async_llm import RequestInfo
from pdserve.engine.messages import ImportParams, KVDestination, KVRankDest, KVReserved, KVTransportSpec
from pdserve.sampling_params import SamplingParams

DEAD = "http://127.0.0.1:1"  # nothing listens on port 1
DEST = KVDestination("r1", (3, 4), (KVRankDest("127.0.0.1:7000", 0, 1),), 0, None, KVTransportSpec("nccl"))


class StubLLM:
    """The slice of AsyncLLM the driver uses: one request, and what the driver told the engine about it."""

    def __init__(self, urls: list[str]):
        self.info = RequestInfo("r1", [1, 2, 3], SamplingParams(max_tokens=4), ImportParams(tuple(urls)), time.time())
        self.failed: list[tuple[str, bool]] = []
        self.is_alive = True

    def add_event_listener(self, cb) -> None: ...
    def add_output_hook(self, cb) -> None: ...
    def add_closed_listener(self, cb) -> None: ...

    def request_info(self, rid: str) -> RequestInfo | None:
        return self.info if rid == "r1" else None

    def remote_prefill_failed(self, rid: str, why: str, peer_done: bool) -> None:
        self.failed.append((why, peer_done))

    def remote_prefill_done(self, rid: str) -> None: ...


async def stub(behaviour: str, seen: list):
    """A prefill instance that answers its orders by `behaviour`: ok, refuse (400), drop (closes the connection
    once the order was read), hang (never answers)."""
    async def prefill(request: web.Request) -> web.StreamResponse:
        _, _, _, dest = parse_order(unpack_order(await request.read()))
        seen.append((behaviour, dest))
        if behaviour == "ok":
            return web.json_response({"ok": True, "timings": {"prefill_s": 0.01, "transport": "nccl"}})
        if behaviour == "refuse":
            return web.json_response({"ok": False, "error": {"message": "KV transport mismatch"}}, status=400)
        if behaviour == "drop":
            request.transport.close()
            await asyncio.sleep(5)
        await asyncio.sleep(30)
        return web.json_response({"ok": False})

    app = web.Application()
    app.router.add_post(PREFILL_ROUTE, prefill)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("first,second_gets_it,peer_done", [
    ("refuse", True, None),  # it answered: it writes nothing; the next candidate takes the order
    ("dead", True, None),  # never reached: nothing was sent
    ("drop", False, False),  # sent, no answer: it may still push; nobody else gets the blocks
    ("hang", False, False),  # sent, timed out: likewise
])
def test_an_order_without_an_answer_is_never_sent_elsewhere(first, second_gets_it, peer_done):
    async def main():
        seen: list = []
        runners = []
        try:
            urls = []
            for b in (first, "ok"):
                if b == "dead":
                    urls.append(DEAD)
                    continue
                runner, url = await stub(b, seen)
                runners.append(runner)
                urls.append(url)
            llm = StubLLM(urls)
            driver = DecodeDriver(llm, KVTransferConfig(role="decode", order_timeout_s=1.0, order_backoff_s=0.01))
            await driver.start()
            try:
                ev = KVReserved("r1", DEST, 0, time.time(), 0.0)
                await asyncio.wait_for(driver._drive(ev), 20)
            finally:
                await driver.close()
            return seen, llm.failed, driver.timings.get("r1", {})
        finally:
            for r in runners:
                await r.cleanup()

    seen, failed, timings = asyncio.run(main())
    assert all(dest == DEST for _, dest in seen)  # the order carries the decode side's transport
    assert ("ok" in [b for b, _ in seen]) == second_gets_it, seen
    if second_gets_it:
        assert failed == [] and timings["transport"] == "nccl", (failed, timings)
    else:
        assert len(failed) == 1 and failed[0][1] is peer_done and "failed" in failed[0][0], failed

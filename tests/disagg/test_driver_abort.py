"""The decode side's order driver tells its engine when nobody writes into the reserved blocks of an aborted
request any more, so they leave quarantine at once instead of at the end of the KV lease (30 s by default).

The kill tests (benchmarks/faults/kill_table.py) saw it: a router dies, so the decode instance's clients go away,
and now and then one request's blocks stayed quarantined for the whole lease. The engine's abort of a request
waiting for its KV quarantines the blocks (it cannot know whether a peer still writes) and drops the request's late
KV notification; only the driver knows whether a peer was ordered and has answered. Two ways to get there: the
client leaves after the prefill peer answered but before the engine took the KV notification, or its abort
crosses the engine's reservation (no order ever went out)."""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import threading
import time
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from pdserve.config import KVTransferConfig
from pdserve.disagg.driver import PREFILL_ROUTE, DecodeDriver
from pdserve.engine.async_llm import RequestInfo
from pdserve.engine.messages import ImportParams, KVDestination, KVRankDest, KVReserved
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams


class FakeLLM:
    """The parts of AsyncLLM the driver uses; records what it is told."""

    is_alive = True

    def __init__(self) -> None:
        self.infos: dict[str, RequestInfo] = {}
        self.told: list[tuple[str, str]] = []

    def add_event_listener(self, cb) -> None:
        self.on_event = cb

    def add_output_hook(self, hook) -> None:
        self.on_output = hook

    def add_closed_listener(self, cb) -> None:
        self.on_closed = cb

    def request_info(self, rid: str) -> RequestInfo | None:
        return self.infos.get(rid)

    def remote_prefill_failed(self, rid: str, reason: str, peer_done: bool) -> None:
        self.told.append(("failed", rid))

    def remote_prefill_done(self, rid: str) -> None:
        self.told.append(("done", rid))

    def close_stream(self, rid: str) -> None:
        """What AsyncLLM does when a client goes away: the request is gone (abort sent), then the listeners."""
        del self.infos[rid]
        self.on_closed(rid)


async def prefill_peer(answer_after: asyncio.Event | None = None) -> tuple[web.AppRunner, str]:
    async def order(request: web.Request) -> web.Response:
        await request.read()
        if answer_after is not None:
            await answer_after.wait()
        return web.json_response({"ok": True, "first_token": 7, "timings": {"prefill_s": 0.01, "push_s": 0.001}})

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "found": False})

    app = web.Application()
    app.router.add_post(PREFILL_ROUTE, order)
    app.router.add_post("/internal/pd/abort", abort)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def reserve(llm: FakeLLM, rid: str, url: str) -> None:
    llm.infos[rid] = RequestInfo(rid, list(range(20)), SamplingParams(max_tokens=4), ImportParams((url,)), time.time())
    dest = KVDestination(rid, (3, 4), (KVRankDest("127.0.0.1:1", 0, 1),))
    llm.on_event(KVReserved(rid, dest, 0, time.time(), 0.0))


async def until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_abort_after_the_peer_answered_releases_the_quarantine_at_once():
    async def main():
        runner, url = await prefill_peer()
        llm = FakeLLM()
        driver = DecodeDriver(llm, KVTransferConfig(role="decode"))
        await driver.start()
        try:
            reserve(llm, "r1", url)
            await until(lambda: not driver.tasks)  # the peer pushed and answered
            assert llm.told == []  # the request lives on: the engine admits it when the KV notification arrives
            llm.close_stream("r1")  # ... but its client left before that
            assert llm.told == [("done", "r1")]
            reserve(llm, "r2", url)  # a request that finished normally needs nothing more
            await until(lambda: not driver.tasks)
            llm.on_output("r2", RequestOutput("r2", [5], " t5", finished=True, finish_reason="length"))
            del llm.infos["r2"]
            assert llm.told == [("done", "r1")] and not driver.delivered
        finally:
            await driver.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_abort_while_the_order_is_out_is_released_once_the_peer_answers():
    async def main():
        gate = asyncio.Event()
        runner, url = await prefill_peer(gate)
        llm = FakeLLM()
        driver = DecodeDriver(llm, KVTransferConfig(role="decode"))
        await driver.start()
        try:
            reserve(llm, "r1", url)
            await until(lambda: "r1" in driver.current)
            llm.close_stream("r1")
            assert llm.told == []  # the peer may still be writing into the blocks
            gate.set()
            await until(lambda: not driver.tasks)
            assert llm.told == [("done", "r1")] and not driver.delivered
        finally:
            await driver.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_client_gone_while_the_engine_reserved_frees_the_blocks_without_an_order():
    """The abort crossed the reservation: the engine quarantined blocks nobody was asked to write."""

    async def main():
        orders = []

        async def order(request: web.Request) -> web.Response:
            orders.append(await request.read())
            return web.json_response({"ok": True, "first_token": 7, "timings": {}})

        app = web.Application()
        app.router.add_post(PREFILL_ROUTE, order)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        llm = FakeLLM()
        driver = DecodeDriver(llm, KVTransferConfig(role="decode"))
        await driver.start()
        try:
            # the stream was gone when the reservation reached the server
            dest = KVDestination("r1", (3, 4), (KVRankDest("127.0.0.1:1", 0, 1),))
            llm.on_event(KVReserved("r1", dest, 0, time.time(), 0.0))
            assert llm.told == [("done", "r1")] and not driver.tasks
            # the stream closed after the reservation arrived but before the order went out
            reserve(llm, "r2", url)
            llm.close_stream("r2")
            await until(lambda: not driver.tasks)
            assert llm.told == [("done", "r1"), ("done", "r2")]
            assert orders == []  # no prefill peer was asked to write into them
        finally:
            await driver.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))


class _AnsweringPrefill(http.server.BaseHTTPRequestHandler):
    """A prefill peer that answers every order at once: ok, pushed (it pushes nothing, so the decode engine never
    takes a KV notification for the request, which stands for a notification not taken yet)."""

    answered = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"ok": True, "first_token": 5, "found": False, "timings": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.path == PREFILL_ROUTE:
            _AnsweringPrefill.answered.set()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_client_gone_after_the_prefill_answered_leaves_no_quarantine_on_a_live_decode(tmp_path):
    from pdserve.model.dummy_tokenizer import wordlevel_tokenizer_dir
    from pdserve.model.loader import load_config, resolve_model
    from tests.engine.tiny_models import write_tiny_model
    from tests.server.live_server import LiveServer, pd_headers

    model = write_tiny_model("gemma3", tmp_path / "gemma3")
    tok = wordlevel_tokenizer_dir(load_config(resolve_model(str(model)))[0], tmp_path)
    peer = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnsweringPrefill)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    decode = LiveServer("--role", "decode", "--model", str(model), "--tokenizer", str(tok), "--max-model-len", "256",
                        "--num-gpu-blocks", "64", "--block-size", "4", "--dtype", "float32", "--kv-transport", "tcp")
    try:
        url = urlsplit(decode.url)
        body = json.dumps({"model": decode.model, "prompt": " ".join(f"t{5 + i}" for i in range(30)), "max_tokens": 4,
                           "stream": True, "pd": {"prefill_urls": [f"http://127.0.0.1:{peer.server_port}"],
                                                  "request_id": "gone-1"}}).encode()
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.request("POST", "/v1/completions", body=body, headers=pd_headers(body))
        assert _AnsweringPrefill.answered.wait(30), "the decode instance sent no order"
        time.sleep(0.5)  # the driver has the answer; the engine still waits for the KV notification
        assert decode.get_json("/load")["pd"]["waiting_for_kv"] == 1
        conn.close()  # the client goes away (as when the router in front of it dies)
        deadline = time.monotonic() + 5  # well inside the 30 s lease: only the driver's word frees the blocks
        while True:
            load = decode.get_json("/load")
            if load["num_free_blocks"] == load["num_total_blocks"] and not load["pd"]["quarantine_blocks"] \
                    and load["num_remote"] == 0:
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.1)
    finally:
        decode.stop()
        peer.shutdown()

"""etcd metadata backend: request encoding, a round trip through an in-process stand-in of etcd's v3 JSON gateway,
and (when an etcd binary is installed) the real thing."""

import asyncio
import base64
import json
import shutil
import socket
import subprocess
import tempfile
import time

import pytest
from aiohttp import web

from pdserve.kv import AgentConfig, KVAgent, PeerUnreachableError
from pdserve.kv.metadata import decode_range, prefix_end, put_request, range_request
from tests.kv.kv_helpers import OPEN


def test_request_encoding():
    req = put_request("/pdserve/kv/agents/d0", {"address": "10.0.0.2:7000"}, lease="694d77aa9e38260f")
    assert base64.b64decode(req["key"]) == b"/pdserve/kv/agents/d0"
    assert json.loads(base64.b64decode(req["value"])) == {"address": "10.0.0.2:7000"}
    assert req["lease"] == "694d77aa9e38260f"
    r = range_request("/a/", prefix=True)
    assert base64.b64decode(r["range_end"]) == b"/a0"  # '/' + 1 == '0'
    assert prefix_end("az") == b"a{" and prefix_end("a\xff") == b"a" + b"\xc3\xc0"
    resp = {"kvs": [{"key": req["key"], "value": req["value"]}], "count": "1"}
    assert decode_range(resp) == {"/pdserve/kv/agents/d0": {"address": "10.0.0.2:7000"}}
    assert decode_range({"count": "0"}) == {}


class FakeEtcd:
    """The subset of etcd's /v3 gateway the backend uses, with etcd's base64 and string-number conventions."""

    def __init__(self) -> None:
        self.kv: dict[bytes, tuple[bytes, str | None]] = {}
        self.leases: dict[str, int] = {}
        self.calls: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("lease/grant", "lease/keepalive", "lease/revoke", "kv/put", "kv/range", "kv/deleterange"):
            app.router.add_post("/v3/" + path, self.handler(path))
        return app

    def handler(self, path):
        async def h(request: web.Request) -> web.Response:
            body = await request.json()
            self.calls.append(path)
            if path == "lease/grant":
                lid = str(7000 + len(self.leases))
                self.leases[lid] = int(body["TTL"])
                return web.json_response({"ID": lid, "TTL": str(body["TTL"])})
            if path == "lease/revoke":
                self.leases.pop(str(body["ID"]), None)
                for k in [k for k, (_, lease) in self.kv.items() if lease == str(body["ID"])]:
                    del self.kv[k]
                return web.json_response({})
            if path == "lease/keepalive":
                return web.json_response({"result": {"ID": body["ID"], "TTL": "30"}})
            key = base64.b64decode(body["key"])
            if path == "kv/put":
                if body.get("lease") and str(body["lease"]) not in self.leases:
                    return web.json_response({"error": "lease not found", "code": 5}, status=400)
                self.kv[key] = (base64.b64decode(body["value"]), body.get("lease"))
                return web.json_response({"header": {}})
            end = base64.b64decode(body["range_end"]) if "range_end" in body else None
            keys = [k for k in self.kv if (k == key if end is None else key <= k < end)]
            if path == "kv/deleterange":
                for k in keys:
                    del self.kv[k]
                return web.json_response({"deleted": str(len(keys))})
            kvs = [{"key": base64.b64encode(k).decode(), "value": base64.b64encode(self.kv[k][0]).decode()} for k in keys]
            return web.json_response({"kvs": kvs, "count": str(len(kvs))} if kvs else {"count": "0"})

        return h


async def _roundtrip(url: str) -> None:
    cfg = {"transport": "tcp", "metadata": "etcd", "etcd_url": url, "etcd_prefix": f"/pdserve-test-{time.time_ns()}/",
           **OPEN}
    a = KVAgent(AgentConfig(name="prefill-0", **cfg))
    b = KVAgent(AgentConfig(name="decode-0", **cfg))
    await a.start()
    await b.start()
    assert await a.connect("decode-0") == "decode-0"
    assert a.peer("decode-0").address == b.address
    listed = await a._meta.list()
    assert set(listed) == {"prefill-0", "decode-0"}
    with pytest.raises(PeerUnreachableError, match="no KV agent named 'decode-9'"):
        await a.connect("decode-9")
    await b.close()
    assert await a._meta.lookup("decode-0") is None  # unpublished on close
    await a.close()


@pytest.mark.timeout(60)
def test_agents_find_each_other_by_name_through_the_gateway():
    fake = FakeEtcd()

    async def main():
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            await _roundtrip(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert fake.calls.count("lease/grant") == 2 and "kv/deleterange" in fake.calls


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary (apt-get install etcd-server)")
def test_real_etcd():
    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        cport, pport = s1.getsockname()[1], s2.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        url = f"http://127.0.0.1:{cport}"
        proc = subprocess.Popen(["etcd", "--data-dir", d, "--listen-client-urls", url, "--advertise-client-urls", url,
                                 "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-cluster", f"default=http://127.0.0.1:{pport}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", cport), timeout=0.5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "etcd did not start"
                    time.sleep(0.2)
            asyncio.run(_roundtrip(url))
        finally:
            proc.kill()
            proc.wait(10)

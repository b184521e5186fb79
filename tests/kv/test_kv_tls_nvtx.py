"""TLS on control connections (certificates made with the openssl command line), and NVTX ranges around transfers on
both sides (a recording stand-in for torch.cuda.nvtx, since CUDA is absent here)."""

import asyncio
import shutil
import subprocess
import time

import numpy as np
import pytest

from pdserve.kv import PeerUnreachableError
from pdserve.kv import nvtx as kv_nvtx
from pdserve.kv.wire import PREAMBLE_CTRL
from tests.kv.attack_helpers import RecordingProxy
from tests.kv.kv_helpers import BB, GRANTS, local_agent


def _cert(d, name: str) -> tuple[str, str]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_control_connections(tmp_path):
    cert, key = _cert(tmp_path, "deploy")
    other, _ = _cert(tmp_path, "other")
    tls = {"tls_cert": cert, "tls_key": key, "tls_ca": cert, "tls_check_hostname": True}

    async def main():
        b, pb, rb = local_agent(name="decode", **GRANTS, **tls)
        a, pa, ra = local_agent(name="prefill", **GRANTS, **tls)
        pa.fill(6)
        await b.start()
        proxy = RecordingProxy(b.address)
        await proxy.start()
        peer = await a.connect(proxy.address)
        a.peer(peer).address = b.address
        b.grant_blocks("t", "kv", [3], BB, "w", time.time() + 30)
        await a.write_blocks(peer, [1], [3], BB, ra, "kv", notif={"request_id": "t"}, key="t")
        note = await b.wait_notification(timeout=5)
        assert note.payload_dict() == {"request_id": "t"} and np.array_equal(pb.data[3], pa.data[1])
        ctl = bytes(proxy.sessions[0])
        assert ctl.startswith(PREAMBLE_CTRL) and ctl[8] == 0x16  # a TLS handshake record follows the preamble
        assert b"hello" not in ctl and b"request_id" not in ctl  # frames travel encrypted
        plain, _, _ = local_agent(name="plain", **GRANTS)  # the same secret, no TLS: refused
        with pytest.raises(PeerUnreachableError):
            await plain.connect(b.address)
        wrong_ca, _, _ = local_agent(name="wrong-ca", **GRANTS, **{**tls, "tls_ca": other})
        with pytest.raises(PeerUnreachableError, match="certificate verify failed|CERTIFICATE_VERIFY_FAILED"):
            await wrong_ca.connect(b.address)
        for x in (a, b, plain, wrong_ca):
            await x.close()
        await proxy.close()

    asyncio.run(main())


class _Recorder:
    def __init__(self) -> None:
        self.open: dict[int, str] = {}
        self.done: list[str] = []
        self.marks: list[str] = []
        self._n = 0

    def range_start(self, msg: str) -> int:
        self._n += 1
        self.open[self._n] = msg
        return self._n

    def range_end(self, rid: int) -> None:
        self.done.append(self.open.pop(rid))

    def mark(self, msg: str) -> None:
        self.marks.append(msg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("enabled", [True, False])
def test_nvtx_ranges_around_every_transfer_on_both_sides(monkeypatch, enabled):
    rec = _Recorder()
    monkeypatch.setattr(kv_nvtx, "_backend", rec)
    monkeypatch.setattr(kv_nvtx, "_resolved", True)

    async def main():
        b, pb, rb = local_agent(name="decode", nvtx=enabled)
        a, pa, ra = local_agent(name="prefill", nvtx=enabled, tcp_connections=1)
        await b.start()
        peer = await a.connect(b.address)
        res = await a.write_blocks(peer, [1, 2], [3, 4], BB, ra, "kv", notif={"request_id": "n"})
        await a.read_blocks(peer, [5], [6], BB, ra, "kv")
        await b.wait_notification(timeout=5)
        await a.close()
        await b.close()
        return res.xfer_id

    xid = asyncio.run(main())
    if not enabled:
        assert (rec.open, rec.done, rec.marks) == ({}, [], [])
        return
    assert rec.open == {}  # every range closed
    # the initiator names its peer (decode), the receiver names the sender (prefill)
    assert sorted(m.split(" #")[0] for m in rec.done) == [
        "kv.read decode", "kv.serve read prefill", "kv.serve write prefill", "kv.write decode"]
    assert f"kv.write decode #{xid} {2 * BB}B" in rec.done and f"kv.serve write prefill #{xid}" in rec.done
    assert rec.marks == [f"kv.notification write prefill #{xid}"]

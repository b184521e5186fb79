"""Bounds on the KV port: announced sizes allocate nothing, idle connections hold no threads and are closed, per-peer
and total connection limits hold, and through all of it a legitimate peer still connects and transfers."""

import asyncio
import concurrent.futures
import os
import socket
import time

import numpy as np
import pytest

from pdserve.kv import LimitExceededError, XferList
from pdserve.kv.wire import MAGIC, OP_WRITE, PREAMBLE_CTRL, PREAMBLE_DATA, REQ, RESP, pack_handshake
from tests.kv.attack_helpers import data_client, proc_status, raw, read_all, write_header
from tests.kv.kv_helpers import BB, NB, SECRET, local_agent, spawn_peer


@pytest.fixture
def victim():
    r = spawn_peer("victim")
    yield r
    r.close()


def _legit_write(address: str, seed: int) -> list[str]:
    """A legitimate peer connects and writes its blocks 0..31 into the victim's last 32; returns their checksums."""
    async def main():
        a, pa, ra = local_agent(name=f"legit-{seed}", tcp_connections=2)
        pa.fill(seed)
        peer = await a.connect(address)
        await a.write_blocks(peer, list(range(32)), list(range(NB - 32, NB)), BB, ra, "kv", notif={"t0": 0})
        sums = pa.checksums(list(range(32)))
        await a.close()
        return sums

    return asyncio.run(main())


def write_header_unauth() -> bytes:
    """The previous protocol's WRITE header announcing 2**22 descriptors (no handshake, no MAC)."""
    return REQ.pack(MAGIC, OP_WRITE, 0, 0, 1, 0, 1 << 22, 0, 1, (1 << 22) * 24)


@pytest.mark.timeout(180)
def test_announced_descriptor_floods_allocate_nothing(victim):
    info = victim.call("info")
    addr, pid = info["address"], info["pid"]
    before = proc_status(pid)

    def unauthenticated(_):  # the old attack: a header announcing 2**22 descriptors (96 MiB pre-allocated each)
        s = raw(addr)
        s.sendall(PREAMBLE_DATA + b"\x01\x00x" + write_header_unauth())
        return read_all(s, timeout=5)

    def authenticated(i):  # a peer holding the secret tries the same: refused on the header, before the body
        s, session = data_client(addr, SECRET, f"greedy-{i}")
        s.sendall(write_header(session, ndescs=1 << 22, total=(1 << 22) * BB, xfer_id=i))
        return read_all(s, timeout=5)

    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        for data, closed in ex.map(unauthenticated, range(200)):
            assert closed and data == b""
        answers = list(ex.map(authenticated, range(200)))
    for data, closed in answers:
        assert closed
        _, status, _, _ = RESP.unpack(data[:RESP.size])
        assert status == 3 and b"4194304 descriptors exceed this agent's limit of 65536" in data[RESP.size:]
    after = proc_status(pid)
    # 400 such headers would have pre-allocated ~37 GiB before; now the peak grows by buffers and bookkeeping only
    assert after["VmHWM"] - before["VmHWM"] < 64 << 10, (before, after)
    sums = _legit_write(addr, 5)
    assert victim.call("checksums", ids=list(range(NB - 32, NB))) == sums


@pytest.mark.timeout(180)
def test_idle_floods_hold_no_threads_and_a_legit_peer_still_transfers():
    victim = spawn_peer("victim", handshake_timeout_s=2.0, secret=SECRET, open_access=True)
    try:
        info = victim.call("info")
        addr, pid = info["address"], info["pid"]
        _legit_write(addr, 1)  # warm: the victim's pools and threads exist as in steady state
        base = proc_status(pid)
        socks = []
        for i in range(300):  # silent, preamble only, half a hello
            s = raw(addr)
            if i % 3 == 1:
                s.sendall(PREAMBLE_CTRL)
            elif i % 3 == 2:
                s.sendall(PREAMBLE_DATA + pack_handshake({"t": "hello", "v": 2, "role": "data", "ni": os.urandom(32)})[:20])
            socks.append(s)
        time.sleep(0.5)
        flooded = proc_status(pid)
        assert flooded["Threads"] <= base["Threads"] + 1, (base, flooded)  # no thread per connection
        assert flooded["VmRSS"] - base["VmRSS"] < 32 << 10, (base, flooded)
        sums = _legit_write(addr, 2)  # the oldest idle connections make room: the real peer gets in
        assert victim.call("checksums", ids=list(range(NB - 32, NB))) == sums
        time.sleep(2.5)  # past the handshake timeout: every flood connection has been closed by the victim
        closed = 0
        for s in socks:
            s.settimeout(0.5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
            s.close()
        assert closed == 300
    finally:
        victim.close()


@pytest.mark.timeout(60)
def test_connection_limits_per_peer_and_total_and_idle_timeouts():
    async def main():
        b, pb, rb = local_agent(name="decode", max_connections_per_peer=3, max_connections=20,
                                max_pending_handshakes=10, handshake_timeout_s=0.5, data_idle_timeout_s=0.6)
        addr = await b.start()
        loop = asyncio.get_running_loop()

        def greedy():
            out = []
            for _ in range(5):
                try:
                    s, _ = data_client(addr, SECRET, "greedy")
                    out.append(s)
                except Exception as e:  # the 4th and 5th are turned away after authenticating
                    out.append(str(e))
            return out

        got = await loop.run_in_executor(None, greedy)
        assert [isinstance(g, socket.socket) for g in got] == [True, True, True, False, False]
        assert all("too many connections from this peer" in g for g in got[3:])
        assert b.port_stats()["per_peer"] == {"greedy": 3}
        # authenticated but idle data connections are closed after data_idle_timeout_s
        await asyncio.sleep(1.2)
        assert b.port_stats()["per_peer"] == {}
        assert all(g.recv(1) == b"" for g in got[:3])
        # unauthenticated ones after handshake_timeout_s, and never more than max_pending_handshakes at once
        silent = await loop.run_in_executor(None, lambda: [raw(addr) for _ in range(30)])
        await asyncio.sleep(0.2)
        st = b.port_stats()
        assert st["pending"] <= 10 and st["connections"] <= 20
        await asyncio.sleep(0.8)
        assert b.port_stats() == {"connections": 0, "pending": 0, "per_peer": {}}
        for s in silent:
            s.close()
        # a real peer's pooled data connection that the server idled out is replaced, not reused
        a, pa, ra = local_agent(name="prefill", data_idle_timeout_s=0.6)
        pa.fill(9)
        peer = await a.connect(addr)
        await a.write_blocks(peer, [1], [2], BB, ra, "kv")
        await asyncio.sleep(1.0)
        await a.write_blocks(peer, [3], [4], BB, ra, "kv")
        assert np.array_equal(pb.data[[2, 4]], pa.data[[1, 3]])
        # the sender's own limits: too many descriptors never leave
        x = XferList.build(ra, np.arange(0, 2 * NB, 2) * 8, a.peer(peer).region_id("kv"), np.arange(NB) * 8, 4)
        a.config.max_descs_per_transfer = 10
        with pytest.raises(LimitExceededError, match="exceed max_descs_per_transfer=10"):
            await a.write(peer, x)
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_oversized_control_frame_ends_that_connection_only():
    async def main():
        b, pb, rb = local_agent(name="decode", max_frame_bytes=64 << 10)
        a, pa, ra = local_agent(name="prefill")
        await b.start()
        peer = await a.connect(b.address)
        await a.peer(peer).send({"t": "padding", "blob": bytes(100 << 10)})
        for _ in range(100):
            if "prefill" not in b.peers:
                break
            await asyncio.sleep(0.02)
        assert "prefill" not in b.peers
        for _ in range(100):
            if not a.peers:
                break
            await asyncio.sleep(0.02)
        peer = await a.connect(b.address)  # the agent is fine
        pa.fill(1)
        await a.write_blocks(peer, [0], [1], BB, ra, "kv")
        assert np.array_equal(pb.data[1], pa.data[0])
        await a.close()
        await b.close()

    asyncio.run(main())

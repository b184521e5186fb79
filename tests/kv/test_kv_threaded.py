"""The synchronous facade: a plain (non-asyncio) loop starts transfers, polls futures and notifications."""

import threading
import time

import numpy as np
import pytest

from pdserve.bench.transfer_worker import Pool
from pdserve.kv import AccessDeniedError, AgentConfig, PeerDisconnectedError, ThreadedAgent, TransferTimeoutError
from tests.kv.kv_helpers import BB, NB, OPEN


@pytest.mark.timeout(60)
def test_threaded_agents_write_poll_and_notify():
    pa, pb = Pool(NB, BB, "numpy", "cpu"), Pool(NB, BB, "numpy", "cpu")
    pa.fill(7)
    secret = OPEN["secret"]  # with grants: the decode side admits exactly the blocks it reserved per request
    with ThreadedAgent(AgentConfig(transport="tcp", name="prefill", secret=secret)) as a, \
            ThreadedAgent(AgentConfig(transport="tcp", name="decode", secret=secret)) as b:
        ra, rb = a.register(pa.data, "kv"), b.register(pb.data, "kv")
        peer = a.connect(b.address)
        assert peer == "decode"
        seen: list[tuple[str, dict]] = []
        got = threading.Event()

        def on_note(n):
            seen.append((threading.current_thread().name, n.unpack() if n.op == "write" else {"op": n.op}))
            got.set()

        b.on_notification(on_note)
        futs = []
        for i in range(4):  # the decode engine reserves blocks and grants them; the prefill engine pushes
            b.grant_blocks(f"r{i}", "kv", [50 + 2 * i, 51 + 2 * i], BB, "w", time.time() + 30, peer="prefill")
            futs.append(a.write_blocks(peer, [4 * i, 4 * i + 1], [50 + 2 * i, 51 + 2 * i], BB, ra, "kv",
                                       notif={"request_id": f"r{i}", "first_token": i}, key=f"r{i}"))
        deadline = time.monotonic() + 10
        while not all(f.done() for f in futs):  # ... and polls on later steps
            assert time.monotonic() < deadline
            time.sleep(0.001)
        results = [f.result() for f in futs]
        assert [r.nbytes for r in results] == [2 * BB] * 4
        assert got.wait(5)
        deadline = time.monotonic() + 5
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(p["request_id"] for _, p in seen[:4]) == ["r0", "r1", "r2", "r3"]
        assert all(t == "kv-agent-loop" for t, _ in seen)
        for i in range(4):
            assert np.array_equal(pb.data[50 + 2 * i:52 + 2 * i], pa.data[4 * i:4 * i + 2])
        # READ with a blocking wait on the other side
        b.grant("x0", rb, [(0, 2 * BB)], "r", time.time() + 30)  # exported for reading (to any peer)
        f = a.read_blocks(peer, [0, 1], [90, 91], BB, ra, a.peer_region_id(peer, "kv"), notif=b"read", key="x0")
        f.result(10)
        assert np.array_equal(pa.data[90:92], pb.data[0:2])
        with pytest.raises(TransferTimeoutError):
            a.wait_notification(timeout=0.2)
        deadline = time.monotonic() + 5
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen[4][1] == {"op": "read"}  # the reader told us it is done with our blocks
        assert b.poll_notifications() == []  # with a callback registered nothing is queued
        assert all(b.revoke(k) == 0 for k in ("r0", "r1", "r2", "r3", "x0"))  # nothing still copying
        with pytest.raises(AccessDeniedError, match="no live 'w' grant for key 'r0'"):  # revoked: refused
            a.write_blocks(peer, [0], [50], BB, ra, "kv", key="r0").result(10)
        b.deregister(rb)


@pytest.mark.timeout(60)
def test_threaded_wait_notification_fails_when_peer_closes():
    a = ThreadedAgent(AgentConfig(transport="tcp", name="p", **OPEN))
    b = ThreadedAgent(AgentConfig(transport="tcp", name="d", **OPEN))
    try:
        a.connect(b.address)
        time.sleep(0.2)
        fut = b.submit(b.agent.wait_notification(peer="p", timeout=20))
        time.sleep(0.1)
        a.close()
        with pytest.raises(PeerDisconnectedError, match="p"):
            fut.result(5)
        polled = b.poll_notifications()
        assert polled == []
    finally:
        a.close()
        b.close()

"""Grants: an authenticated peer writes only into the blocks reserved for it and that request, reads only what was
exported to it, until the deadline; a refused transfer fails that request alone."""

import asyncio
import time

import numpy as np
import pytest

from pdserve.kv import AccessDeniedError, AgentConfig, KVAgent, KVTransferError, RegionError
from pdserve.kv.grants import Grants
from tests.kv.kv_helpers import BB, GRANTS, local_agent


async def _pair(**kw):
    b, pb, rb = local_agent(name="decode", **GRANTS, **kw)
    a, pa, ra = local_agent(name="prefill", tcp_connections=2, **GRANTS, **kw)
    pa.fill(11)
    await b.start()
    peer = await a.connect(b.address)
    notes = []
    b.on_notification(notes.append)
    return a, pa, ra, b, pb, rb, peer, notes


@pytest.mark.timeout(60)
def test_write_outside_its_grant_fails_only_that_request():
    async def main():
        a, pa, ra, b, pb, rb, peer, notes = await _pair()
        now = time.time()
        b.grant_blocks("good", "kv", range(10, 58), BB, "w", now + 30, peer="prefill")
        b.grant_blocks("bad", "kv", [60, 61, 62, 63], BB, "w", now + 30, peer="prefill")
        pb.data[64:66] = 7  # next to the bad grant: must stay as it is
        # a large legitimate push (striped over both connections) and, at the same time, one overrunning its grant
        good = a.write_blocks(peer, list(range(48)), list(range(10, 58)), BB, ra, "kv", notif={"request_id": "good"},
                              key="good")
        bad = a.write_blocks(peer, [0, 1, 2, 3, 4, 5], [60, 61, 62, 63, 64, 65], BB, ra, "kv",
                             notif={"request_id": "bad"}, key="bad")
        res_good, res_bad = await asyncio.gather(good, bad, return_exceptions=True)
        assert res_good.nbytes == 48 * BB
        assert isinstance(res_bad, AccessDeniedError) and "lies outside the 'w' grant of key 'bad'" in str(res_bad)
        assert np.array_equal(pb.data[10:58], pa.data[:48])  # the legitimate bytes, exactly
        assert not pb.data[60:64].any() and (pb.data[64:66] == 7).all()  # nothing of the refused one landed
        await asyncio.sleep(0.2)
        got = sorted((n.key, n.error is None) for n in notes)
        assert got == [("bad", False), ("good", True)]  # the receiver hears once of each, the bad one as failed
        # a key granted to this peer cannot be used for other blocks; a key never granted is refused silently
        with pytest.raises(AccessDeniedError, match="outside the 'w' grant of key 'good'"):
            await a.write_blocks(peer, [0], [5], BB, ra, "kv", key="good")
        with pytest.raises(AccessDeniedError, match="no live 'w' grant for key 'nobody'"):
            await a.write_blocks(peer, [0], [5], BB, ra, "kv", notif={"request_id": "nobody"}, key="nobody")
        with pytest.raises(AccessDeniedError, match="carries no key"):
            await a.write_blocks(peer, [0], [5], BB, ra, "kv")
        await asyncio.sleep(0.2)
        assert sorted((n.key, n.error is None) for n in notes) == [("bad", False), ("good", False), ("good", True)]
        assert not pb.data[:10].any()
        # the connection and the grant stay usable
        await a.write_blocks(peer, [47], [57], BB, ra, "kv", key="good")
        assert np.array_equal(pb.data[57], pa.data[47])
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_grants_admit_only_their_peer_and_expire():
    async def main():
        a, pa, ra, b, pb, rb, peer, notes = await _pair()
        b.grant_blocks("other", "kv", [1], BB, "w", time.time() + 30, peer="someone-else")
        with pytest.raises(AccessDeniedError, match="no live 'w' grant for key 'other' admits peer 'prefill'"):
            await a.write_blocks(peer, [0], [1], BB, ra, "kv", notif={"request_id": "other"}, key="other")
        await a.notify(peer, {"request_id": "other"}, key="other")
        b.grant_blocks("soon", "kv", [2], BB, "w", time.time() + 0.5, peer="prefill")
        await a.write_blocks(peer, [0], [2], BB, ra, "kv", notif={"request_id": "soon"}, key="soon")
        await asyncio.sleep(0.7)
        with pytest.raises(AccessDeniedError, match="no live 'w' grant for key 'soon'"):
            await a.write_blocks(peer, [1], [2], BB, ra, "kv", key="soon")
        await a.notify(peer, {"late": True}, key="soon")
        await asyncio.sleep(0.2)
        assert [(n.key, n.op, n.error) for n in notes] == [("soon", "write", None)]
        assert not pb.data[1].any() and np.array_equal(pb.data[2], pa.data[0])
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_reads_need_an_export_grant():
    async def main():
        a, pa, ra, b, pb, rb, peer, notes = await _pair()
        pb.fill(5)
        rr = a.peer(peer).region_id("kv")
        with pytest.raises(AccessDeniedError):
            await a.read_blocks(peer, [3, 4], [0, 1], BB, ra, rr, key="x")
        b.grant_blocks("x", "kv", [3, 4], BB, "w", time.time() + 30)  # a write grant does not allow reading
        with pytest.raises(AccessDeniedError, match="no live 'r' grant for key 'x'"):
            await a.read_blocks(peer, [3, 4], [0, 1], BB, ra, rr, key="x")
        b.grant_blocks("x", "kv", [3, 4], BB, "r", time.time() + 30)
        with pytest.raises(AccessDeniedError, match="outside the 'r' grant"):
            await a.read_blocks(peer, [3, 4, 5], [0, 1, 2], BB, ra, rr, key="x")
        pa.data[:3] = 0
        await a.read_blocks(peer, [3, 4], [0, 1], BB, ra, rr, notif=b"done", key="x")
        assert np.array_equal(pa.data[:2], pb.data[3:5]) and not pa.data[2].any()
        await asyncio.sleep(0.2)
        assert [(n.key, n.op, n.payload) for n in notes if n.error is None] == [("x", "read", b"done")]
        await a.close()
        await b.close()

    asyncio.run(main())


def test_grant_arguments_are_checked():
    b = KVAgent(AgentConfig(secret=b"s" * 32, max_grants=3))
    buf = np.zeros(1000, dtype=np.uint8)
    b.register(buf, "kv")
    now = time.time()
    b.grant("k", "kv", [(0, 10), (10, 10), (500, 500)], "w", now + 10)
    for bad, match in (((0, 1001),), "exceeds the region"), (((-1, 5),), "offsets >= 0"), (((5, 0),), "lengths > 0"), \
            (((8, (1 << 63) - 1),), "exceeds the region"), ((1, 2, 3), "pairs"):
        with pytest.raises(ValueError, match=match):
            b.grant("k2", "kv", list(bad), "w", now + 10)
    with pytest.raises(ValueError, match="'w' or 'r'"):
        b.grant("k2", "kv", [(0, 1)], "rw", now + 10)
    with pytest.raises(ValueError, match="not in the future"):
        b.grant("k2", "kv", [(0, 1)], "w", time.monotonic() - 1e9)  # a monotonic clock passed by mistake
    with pytest.raises(ValueError, match="more than max_grant_s"):
        b.grant("k2", "kv", [(0, 1)], "w", now + 10 * 3600)
    with pytest.raises(ValueError, match="non-empty str"):
        b.grant("", "kv", [(0, 1)], "w", now + 10)
    with pytest.raises(RegionError):
        b.grant("k2", "nope", [(0, 1)], "w", now + 10)
    b.grant("k2", "kv", [], "w", now + 10)
    b.grant("k3", "kv", [], "r", now + 10)
    with pytest.raises(ValueError, match="limit"):
        b.grant("k4", "kv", [], "r", now + 10)
    assert b.revoke("k3") == 0 and b.revoke("k3") == 0
    b.grant("k4", "kv", [], "r", now + 10)


def test_grant_checks_are_exact():
    clock = [1000.0]
    g = Grants(100, 3600, clock=lambda: clock[0])
    g.add("k", 1, 10_000, [(100, 100), (200, 50), (1000, 10)], "w", 1010.0, peer="p")
    g.add("k", 1, 10_000, [(250, 50)], "w", 1005.0)  # a second grant continuing the first: runs may span both
    g.add("k", 2, 10_000, [(0, 10_000)], "r", 1010.0, peer="p")

    def ok(peer, op, region, offset, length):
        a = [np.asarray(v, dtype=np.int64) for v in (region, offset, length)]
        return g.check("k", peer, op, *a).ok

    assert ok("p", "write", [1, 1], [100, 1000], [200, 10])
    assert ok("p", "write", [1], [100], [200])
    assert ok("p", "write", [1], [120], [180])  # [120, 300) crosses from the first grant into the second
    assert not ok("p", "write", [1], [99], [2])
    assert not ok("p", "write", [1], [290], [11])
    assert not ok("p", "write", [1, 1], [100, 1005], [10, 6])
    assert not ok("p", "write", [2], [0], [10])  # region 2 is exported for reading only
    assert ok("p", "read", [2], [9990], [10]) and not ok("q", "read", [2], [0], [1])
    assert ok("q", "write", [1], [250], [50]) and not ok("q", "write", [1], [200], [60])  # only the open grant
    clock[0] = 1006.0  # the open grant expired
    assert not ok("p", "write", [1], [120], [180]) and ok("p", "write", [1], [100], [150])
    assert g.allows_notify("k", "p", "write") and not g.allows_notify("k", "q", "notify")
    clock[0] = 1011.0
    assert not ok("p", "write", [1], [100], [10]) and not g.allows_notify("k", "p", "notify")
    assert len(g) == 1 and g.add("z", 1, 100, [], "w", 1012.0) and len(g) == 2


@pytest.mark.timeout(60)
def test_failed_transfers_reach_the_receiver_once():
    async def main():
        a, pa, ra, b, pb, rb, peer, notes = await _pair()
        b.grant_blocks("r", "kv", [1, 2], BB, "w", time.time() + 30, peer="prefill")
        with pytest.raises(KVTransferError):
            await a.write_blocks(peer, [0, 1, 2], [1, 2, 3], BB, ra, "kv", notif={"request_id": "r"}, key="r")
        await asyncio.sleep(0.3)
        # refused by the receiver (which tells its engine) and reported by the sender: one failed notification
        assert [(n.key, n.error is not None, n.payload_dict()) for n in notes] == [("r", True, {"request_id": "r"})]
        with pytest.raises(KVTransferError, match="failed"):
            notes[0].raise_if_failed()
        await a.close()
        await b.close()

    asyncio.run(main())

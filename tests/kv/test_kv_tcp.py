"""tcp transport between processes: byte-exact random block lists, concurrent peers, bad descriptors, refused
connections. Peers run in spawned processes (pdserve.bench.transfer_worker), the local agent in the test process."""

import asyncio
import socket

import numpy as np
import pytest

from pdserve.kv import InvalidDescriptorError, KVTransferError, PeerUnreachableError, XferList, block_xfers
from tests.kv.kv_helpers import BB, NB, local_agent, spawn_peer


@pytest.fixture
def peers():
    made = []

    def make(name, **kw):
        r = spawn_peer(name, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()

@pytest.mark.timeout(120)
def test_random_block_lists_between_processes_arrive_byte_exact(peers):
    a, b = peers("pa"), peers("pb")
    baddr = b.call("info")["address"]
    peer = a.call("connect", address=baddr)
    rng = np.random.default_rng(1)
    for round_, n in enumerate([1, 7, 48, NB]):
        src, dst = rng.permutation(NB)[:n].tolist(), rng.permutation(NB)[:n].tolist()
        if round_ == 2:  # partly consecutive runs, so coalescing has work to do
            src, dst = list(range(10, 10 + n)), list(range(40, 40 + n // 2)) + list(range(n // 2))
        for op in ("write", "read"):
            a.call("fill", seed=round_ * 2 + 1)
            b.call("fill", seed=round_ * 2 + 2)
            assert a.call("checksums", ids=src) != b.call("checksums", ids=dst)
            res = a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=1, warmup=0)
            assert res["bytes"] == n * BB and res["transport"] == "tcp"
            assert a.call("checksums", ids=src) == b.call("checksums", ids=dst), (op, n)
            untouched = sorted(set(range(NB)) - set(dst))[:5]
            if op == "write" and untouched:  # bytes outside the destination blocks are left alone
                b.call("fill", seed=99)
                before = b.call("checksums", ids=untouched)
                a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=1, warmup=0)
                assert b.call("checksums", ids=untouched) == before
        if round_ == 2:
            assert res["descs_out"] < res["descs_in"]


@pytest.mark.timeout(120)
def test_arbitrary_descriptors_and_notifications_in_process():
    async def main():
        a, pa, ra = local_agent(tcp_connections=3)
        b, pb, rb = local_agent()
        pa.fill(5)
        await b.start()
        peer = await a.connect(b.address)
        rng = np.random.default_rng(3)
        size = NB * BB
        # random non-overlapping destination runs of odd lengths from random sources
        cuts = np.sort(rng.choice(size, 40, replace=False))
        starts, ends = cuts[0::2], cuts[1::2]
        lens = ends - starts
        srcs = rng.integers(0, size - lens.max(), lens.size)
        x = XferList.build(ra, srcs, rb, starts, lens)
        res = await a.write(peer, x, notif={"request_id": "r-1", "first_token": 42})
        note = await b.wait_notification(peer=a.name, timeout=5)
        assert note.unpack() == {"request_id": "r-1", "first_token": 42} and note.op == "write"
        flat_a, flat_b = pa.data.reshape(-1), pb.data.reshape(-1)
        for s, d, n in zip(srcs, starts, lens):
            assert np.array_equal(flat_b[d:d + n], flat_a[s:s + n])
        assert res.nbytes == int(lens.sum())
        # READ back into other places of A; B is told that its memory was read
        back = block_xfers(list(range(60, 70)), list(range(0, 10)), BB, ra, rb)
        await a.read(peer, back, notif=b"read-done")
        assert np.array_equal(pa.data[60:70], pb.data[0:10])
        n2 = await b.wait_notification(timeout=5)
        assert (n2.op, n2.payload, n2.peer) == ("read", b"read-done", a.name)
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_concurrent_transfers_to_several_peers(peers):
    remotes = [peers(f"pc{i}") for i in range(3)]

    async def main():
        a, pa, ra = local_agent(tcp_connections=2)
        pa.fill(11)
        names = [await a.connect(r.call("info")["address"]) for r in remotes]
        rng = np.random.default_rng(4)
        plans = []
        for _ in names:
            src, dst = rng.permutation(NB)[:NB // 2].tolist(), rng.permutation(NB)[:NB // 2].tolist()
            plans.append((src, dst))
        results = await asyncio.gather(*(
            a.write_blocks(n, s, d, BB, ra, "kv", notif={"t0": 0}) for n, (s, d) in zip(names, plans)))
        assert [r.peer for r in results] == names
        for r, (src, dst) in zip(remotes, plans):
            assert r.call("checksums", ids=dst) == pa.checksums(src)
        await a.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_descriptor_outside_a_region_is_rejected_on_both_sides():
    async def main():
        a, pa, ra = local_agent()
        b, pb, rb = local_agent()
        pa.fill(1)
        await b.start()
        peer = await a.connect(b.address)
        size = NB * BB
        with pytest.raises(InvalidDescriptorError, match="outside region"):
            await a.write(peer, XferList.build(ra, 0, rb, size - 10, 20))
        with pytest.raises(InvalidDescriptorError, match="outside region"):
            await a.read(peer, XferList.build(ra, size - 1, rb, 0, 2))
        # a sender with a stale (too large) idea of the remote region: the receiver must refuse, not write
        a.peer(peer).regions[rb].size = size * 2
        waiter = asyncio.create_task(b.wait_notification(peer=a.name, timeout=10))
        with pytest.raises(InvalidDescriptorError, match="rejected by peer"):
            await a.write(peer, XferList.build(ra, 0, rb, size - 8, 16), notif={"request_id": "bad"})
        with pytest.raises(KVTransferError, match="write .* from peer .* failed: .*outside region"):
            await waiter  # the receiver waiting for that payload learns that it will not come
        with pytest.raises(InvalidDescriptorError, match="rejected by peer"):
            await a.read(peer, XferList.build(ra, 0, rb, size + 64, 16))
        assert not pb.data.any()
        # the connection stayed usable
        await a.write_blocks(peer, [1, 2], [3, 4], BB, ra, rb)
        assert np.array_equal(pb.data[3:5], pa.data[1:3])
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_connection_refused_names_the_address():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now

    async def main():
        a, _, _ = local_agent(connect_timeout_s=2.0)
        with pytest.raises(PeerUnreachableError, match=f"127.0.0.1:{port}"):
            await a.connect(f"127.0.0.1:{port}")
        with pytest.raises(PeerUnreachableError, match="not host:port"):
            await a.connect("decode-0")
        await a.close()

    asyncio.run(main())

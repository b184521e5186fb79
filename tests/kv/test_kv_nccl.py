"""The nccl transport's own guarantees (Gloo on CPU): the receiver refuses runs outside the key's grant before posting
a receive (that transfer alone fails), both sides keep one order under concurrent transfers in both directions, the
rendezvous needs no listening port and strangers at the communicator's sockets neither read nor write pool bytes,
and the pair store's bounds."""

import asyncio
import hashlib
import random
import socket
import time

import numpy as np
import psutil
import pytest

from pdserve.kv import AccessDeniedError, AgentConfig, KVAgent
from pdserve.kv.errors import TransferTimeoutError, TransportUnavailableError
from pdserve.kv.transports.pair_store import MAX_KEYS, LocalMap, StoreError
from tests.kv.kv_helpers import BB, GRANTS, NB, OPEN, local_agent, spawn_peer


async def _pair(**kw):
    b, pb, rb = local_agent(name="decode", transport="nccl", **kw)
    a, pa, ra = local_agent(name="prefill", transport="nccl", **kw)
    pa.fill(11)
    pb.fill(12)
    await b.start()
    peer = await a.connect(b.address)
    return a, pa, ra, b, pb, rb, peer


@pytest.mark.timeout(60)
def test_write_outside_its_grant_fails_only_that_transfer():
    async def main():
        a, pa, ra, b, pb, rb, peer = await _pair(**GRANTS)
        notes = []
        b.on_notification(notes.append)
        now = time.time()
        b.grant_blocks("good", "kv", range(10, 40), BB, "w", now + 30, peer="prefill")
        b.grant_blocks("bad", "kv", [60, 61, 62, 63], BB, "w", now + 30, peer="prefill")
        before = pb.data[60:66].copy()
        good = a.write_blocks(peer, list(range(30)), list(range(10, 40)), BB, ra, "kv", notif={"r": "good"}, key="good")
        bad = a.write_blocks(peer, [0, 1, 2, 3, 4, 5], [60, 61, 62, 63, 64, 65], BB, ra, "kv", notif={"r": "bad"},
                             key="bad")
        res_good, res_bad = await asyncio.gather(good, bad, return_exceptions=True)
        assert res_good.nbytes == 30 * BB and res_good.transport == "nccl"
        assert isinstance(res_bad, AccessDeniedError) and "lies outside the 'w' grant of key 'bad'" in str(res_bad)
        assert np.array_equal(pb.data[10:40], pa.data[:30])
        assert np.array_equal(pb.data[60:66], before)  # nothing of the refused transfer landed
        await asyncio.sleep(0.2)
        assert sorted((n.key, n.error is None) for n in notes) == [("bad", False), ("good", True)]
        with pytest.raises(AccessDeniedError, match="no live 'w' grant for key 'nobody'"):
            await a.write_blocks(peer, [0], [5], BB, ra, "kv", key="nobody")
        with pytest.raises(AccessDeniedError, match="carries no key"):
            await a.write_blocks(peer, [0], [5], BB, ra, "kv")
        # the pair keeps its order after refusals: the next granted transfer still lands
        await a.write_blocks(peer, [47], [39], BB, ra, "kv", key="good")
        assert np.array_equal(pb.data[39], pa.data[47])
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_concurrent_transfers_in_both_directions_keep_one_order():
    async def main():
        a, pa, ra, b, pb, rb, peer_b = await _pair(**OPEN)
        peer_a = next(iter(b.peers))
        rng = random.Random(5)
        jobs, want = [], []
        # a writes from its blocks 0..31 into b's 0..31, b from its 32..63 into a's 32..63; a reads b's 64..71 into
        # its own 64..71, b reads a's 80..87: no block is both read and written, so the outcome is fixed
        for i in range(16):
            s = rng.sample(range(32), 2)
            jobs.append(a.write_blocks(peer_b, s, [2 * i, 2 * i + 1], BB, ra, "kv"))
            want.append((pb, [2 * i, 2 * i + 1], pa.data[s].copy()))
            s = rng.sample(range(32, 64), 2)
            jobs.append(b.write_blocks(peer_a, s, [32 + 2 * i, 33 + 2 * i], BB, rb, "kv"))
            want.append((pa, [32 + 2 * i, 33 + 2 * i], pb.data[s].copy()))
        for i in range(8):
            jobs.append(a.read_blocks(peer_b, [64 + i], [64 + i], BB, ra, "kv"))
            want.append((pa, [64 + i], pb.data[[64 + i]].copy()))
            jobs.append(b.read_blocks(peer_a, [80 + i], [80 + i], BB, rb, "kv"))
            want.append((pb, [80 + i], pa.data[[80 + i]].copy()))
        rng.shuffle(jobs)
        res = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert {r.transport for r in res} == {"nccl"}
        for pool, ids, data in want:
            assert np.array_equal(pool.data[ids], data)
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_strangers_at_the_communicator_sockets_touch_no_pool_bytes():
    """The rendezvous runs on the control connection: the receiver listens on its agent port and Gloo's one
    socket, nothing else. A stranger connecting to them and sending garbage (or waiting for bytes) gets nothing
    of the pool and changes nothing in it; the pair keeps working."""
    dec = spawn_peer("zdec", transport="nccl", **GRANTS)
    try:
        async def main():
            a, pa, ra = local_agent(name="apre", transport="nccl", **GRANTS)
            loop = asyncio.get_running_loop()
            call = lambda *x, **k: loop.run_in_executor(None, lambda: dec.call(*x, **k))  # noqa: E731
            info = await call("info")
            peer = await a.connect(info["address"])
            ids = list(range(NB))
            pa.fill(3)
            # a granted transfer first: the communicator exists (and was probed) once it returns
            await call("grant", key="w0", ids=[0], seconds=30, peer="apre")
            await a.write_blocks(peer, [0], [0], BB, ra, "kv", key="w0")
            before = await call("checksums", ids=ids)
            agent_port = int(info["address"].rpartition(":")[2])
            ports = sorted({c.laddr.port for c in psutil.Process(info["pid"]).net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN} - {agent_port})
            assert len(ports) == 1, f"listening besides the agent port and Gloo's one: {ports}"
            leaked = b""
            for port in ports:
                for payload in (b"", random.Random(1).randbytes(4096), b"\x00" * 64):
                    s = socket.create_connection(("127.0.0.1", port), timeout=2)
                    s.settimeout(1.0)
                    try:
                        if payload:
                            s.sendall(payload)
                        leaked += s.recv(1 << 16)
                    except (TimeoutError, OSError):
                        pass
                    finally:
                        s.close()
            assert leaked == b""  # not a byte of the pool (nor anything else) to a stranger
            assert await call("checksums", ids=ids) == before
            # the pair still moves bytes under a grant
            await call("grant", key="k", ids=[5, 6], seconds=30, peer="apre")
            await a.write_blocks(peer, [1, 2], [5, 6], BB, ra, "kv", notif={"r": 1}, key="k")
            got = await call("checksums", ids=[5, 6])
            assert got == [hashlib.blake2b(pa.data[i].tobytes(), digest_size=16).hexdigest() for i in (1, 2)]
            await a.close()

        asyncio.run(main())
    finally:
        dec.close()


def test_pair_store_semantics_and_bounds():
    m = LocalMap()
    m.call("set", ["a", b"1"], 1)
    assert m.call("get", ["a"], 1) == b"1"
    assert m.call("add", ["n", 2], 1) == 2 and m.call("add", ["n", 3], 1) == 5
    assert m.call("compare_set", ["a", b"1", b"2"], 1) == b"2"
    assert m.call("compare_set", ["a", b"1", b"3"], 1) == b"2"
    assert m.call("check", [["a", "n"]], 1) is True and m.call("check", [["zz"]], 1) is False
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="did not appear within 0.2 s"):
        m.call("get", ["missing"], 0.2)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(StoreError, match="unknown store function"):
        m.call("__class__", [], 1)
    with pytest.raises(StoreError, match="store value"):
        m.call("set", ["big", b"x" * (2 << 20)], 1)
    for i in range(MAX_KEYS - m.call("num_keys", [], 1)):
        m.call("set", [f"k{i}", b""], 1)
    with pytest.raises(StoreError, match="holds 4096 keys"):
        m.call("set", ["one-more", b""], 1)


def test_pair_store_extended_api_through_torch():
    """torch's binding of a Python store asserts ("Not implemented.") for the extended calls a process group may make
    (torch 2.11's NCCL does): the pair store answers them, through torch's own Store methods."""
    from pdserve.kv.transports.pair_store import make_store

    m = LocalMap()
    s = make_store(m.call, 1.0)
    s.set("a", b"1")
    s.append("a", b"23")
    assert s.get("a") == b"123"
    s.multi_set(["x", "y"], [b"1", b"2"])
    assert s.multi_get(["x", "y", "a"]) == [b"1", b"2", b"123"]
    assert s.has_extended_api() is True
    with pytest.raises(StoreError, match="one value per key"):
        m.call("multi_set", [["x"], []], 1)


def test_without_torch_distributed_the_error_says_so(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(TransportUnavailableError, match="transport nccl needs torch built with torch.distributed"):
        KVAgent(AgentConfig(transport="nccl", **OPEN))


@pytest.mark.timeout(60)
def test_a_data_path_that_fails_the_probe_is_never_used():
    """If whoever answers on the new communicator cannot produce the MAC under the deployment secret (here: one side
    derives a different probe key), the pair is not used: the transfer fails at once, saying why."""
    async def main():
        b, pb, rb = local_agent(name="decode", transport="nccl", **OPEN)
        a, pa, ra = local_agent(name="prefill", transport="nccl", **OPEN)
        b.transports["nccl"]._probe_key = bytes(32)
        await b.start()
        peer = await a.connect(b.address)
        t0 = time.monotonic()
        with pytest.raises(TransportUnavailableError, match="failed its probe"):
            await a.write_blocks(peer, [0], [1], BB, ra, "kv", timeout=20)
        assert time.monotonic() - t0 < 15
        assert "failed its probe" in a.peer_transport(peer)["unavailable"]["nccl"]
        assert not pb.data[1].any()
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_stalled_peer_times_out_and_the_pair_is_remade():
    """A peer that stops answering fails the transfer at its deadline; the generation is broken on both sides and
    rank 0 makes a new communicator, so the next transfer after the peer recovers lands."""
    import os
    import signal

    dec = spawn_peer("zdec", transport="nccl", **OPEN)
    try:
        async def main():
            a, pa, ra = local_agent(name="apre", transport="nccl", **OPEN)
            loop = asyncio.get_running_loop()
            call = lambda *x, **k: loop.run_in_executor(None, lambda: dec.call(*x, **k))  # noqa: E731
            peer = await a.connect((await call("info"))["address"])
            pa.fill(9)
            await a.write_blocks(peer, [0], [0], BB, ra, "kv")
            gen = a.transports["nccl"]._peers[peer].pair.gen
            os.kill(dec.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(TransferTimeoutError, match="no answer"):
                await a.write_blocks(peer, [1], [1], BB, ra, "kv", timeout=1.0)
            assert time.monotonic() - t0 < 3.0
            os.kill(dec.proc.pid, signal.SIGCONT)
            res = await a.write_blocks(peer, [2, 3], [2, 3], BB, ra, "kv", timeout=30)
            assert res.transport == "nccl" and a.transports["nccl"]._peers[peer].pair.gen > gen
            want = [hashlib.blake2b(pa.data[i].tobytes(), digest_size=16).hexdigest() for i in (0, 2, 3)]
            assert await call("checksums", ids=[0, 2, 3]) == want
            await a.close()

        asyncio.run(main())
    finally:
        if dec.proc.is_alive():
            os.kill(dec.proc.pid, signal.SIGCONT)
        dec.close()

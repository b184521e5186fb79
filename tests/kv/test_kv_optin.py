"""The opt-in transports (nccl over Gloo on CPU, Mooncake over its TCP) between two processes: random block lists
arrive byte-exact and coalesced, the receiver is notified only after the bytes landed, a killed peer fails pending
transfers quickly and clearly, and the agent API the engine uses (register with unit_bytes, grant_blocks,
write_blocks with key, layer-wise writes with key, notify with key) works unchanged over them."""

import asyncio
import hashlib
import os
import signal
import time

import numpy as np
import pytest

from pdserve.kv import AgentConfig, KVAgent, PeerDisconnectedError, XferList
from pdserve.kv.errors import TransportUnavailableError
from tests.kv.kv_helpers import BB, BIG, GRANTS, NB, OPEN, big_peer, local_agent, spawn_peer


def _mooncake_ok() -> bool:
    from pdserve.kv.transports.mooncake import load_engine

    try:
        load_engine()
    except TransportUnavailableError:
        return False
    return True


MOONCAKE = pytest.mark.skipif(not _mooncake_ok(), reason="Mooncake (mooncake-transfer-engine-non-cuda, libibverbs1) "
                                                         "is not installed")
TRANSPORTS = [pytest.param("nccl", id="nccl-gloo"), pytest.param("mooncake", id="mooncake-tcp", marks=MOONCAKE)]


def kw(transport: str) -> dict:
    """Agent keywords of a transport under test (Mooncake over its TCP: no RDMA device here)."""
    return {"transport": transport, **({"protocol": "tcp"} if transport == "mooncake" else {})}


def digests(pool: np.ndarray, ids) -> list[str]:
    return [hashlib.blake2b(pool[i].tobytes(), digest_size=16).hexdigest() for i in ids]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_block_lists_land_exactly_and_notify_after_landing(transport):
    sender = spawn_peer("zsend", **kw(transport), **GRANTS)  # sorts after the local agent: it is rank 1 for nccl
    try:
        async def main():
            b, pb, rb = local_agent(name="recv", **kw(transport), **GRANTS)
            await b.start()
            loop = asyncio.get_running_loop()
            call = lambda *a, **k: loop.run_in_executor(None, lambda: sender.call(*a, **k))  # noqa: E731
            peer = await call("connect", address=b.address)
            landed = []  # at each notification: did the granted blocks hold the sender's bytes already?
            want: dict[str, list[str]] = {}
            b.on_notification(lambda n: landed.append((n.key, n.error, digests(pb.data, dst_of[n.key]) == want[n.key])))
            rng = np.random.default_rng(1)
            dst_of = {}
            for i, n in enumerate((1, 7, 40)):
                # a run of consecutive ids on both sides (coalesced into one descriptor), the rest in random order
                h = n // 2
                src = list(range(h)) + (h + rng.permutation(NB - h))[: n - h].tolist()
                dst = list(range(50, 50 + h)) + rng.permutation(48)[: n - h].tolist()
                key = f"r{i}"
                dst_of[key] = dst
                await call("fill", seed=i)
                want[key] = await call("checksums", ids=src)
                b.grant_blocks(key, "kv", dst, BB, "w", time.time() + 60, peer="zsend")
                res = await call("xfer", op="write", peer=peer, local_ids=src, remote_ids=dst, iters=1, warmup=0, key=key)
                assert res["transport"] == transport
                if n > 3:
                    assert res["descs_out"] < res["descs_in"]
                assert digests(pb.data, dst) == want[key]
                # the notification comes on the control connection after the write's completion, not with the xfer
                # call's answer: wait for it before revoking the grant (a notification for a revoked grant is dropped)
                deadline = time.monotonic() + 10
                while not any(k == key for k, _, _ in landed):
                    assert time.monotonic() < deadline, f"no notification for {key}"
                    await asyncio.sleep(0.01)
                b.revoke(key)
            assert landed == [("r0", None, True), ("r1", None, True), ("r2", None, True)]
            # a READ the other way, under an "r" grant: the peer pulls our blocks
            pb.data[5:9] = np.arange(4 * BB, dtype=np.uint8).reshape(4, BB) % 251
            b.grant_blocks("rd", "kv", [5, 6, 7, 8], BB, "r", time.time() + 60, peer="zsend")
            await call("xfer", op="read", peer=peer, local_ids=[80, 81, 82, 83], remote_ids=[5, 6, 7, 8], iters=1,
                       warmup=0, key="rd")
            assert await call("checksums", ids=[80, 81, 82, 83]) == digests(pb.data, [5, 6, 7, 8])
            assert b.peer_transports()["zsend"] == {"transport": transport, "unavailable": {}}
            await b.close()

        asyncio.run(main())
    finally:
        sender.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_peer_fails_pending_transfers_within_the_timeouts(transport):
    victim = big_peer("victim", **kw(transport))
    try:
        async def main():
            buf = np.random.default_rng(0).integers(0, 256, BIG, dtype=np.uint8)
            a = KVAgent(AgentConfig(name="killer", io_timeout_s=20.0, **kw(transport), **OPEN))
            rid = a.register(buf, name="big")
            p = await a.connect(victim.call("info")["address"])
            rr = a.peer(p).region_id("kv")
            await a.write(p, XferList.build(rid, 0, rr, 0, 1 << 20))  # warm
            os.kill(victim.proc.pid, signal.SIGSTOP)  # it stops: the next write is surely pending
            task = asyncio.create_task(a.write(p, XferList.build(rid, 0, rr, 0, BIG), notif=b"never"))
            await asyncio.sleep(0.5)
            assert not task.done()
            t0 = time.monotonic()
            os.kill(victim.proc.pid, signal.SIGKILL)
            with pytest.raises(PeerDisconnectedError, match=r"victim at 127\.0\.0\.1:\d+"):
                await task
            assert time.monotonic() - t0 < 5.0
            with pytest.raises(PeerDisconnectedError, match="victim"):
                await a.write(p, XferList.build(rid, 0, rr, 0, 1024))
            await a.close()

        asyncio.run(main())
    finally:
        victim.proc.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_api_unchanged(transport):
    """What pdserve.disagg does, in one process: the pool registered as region "kv" with unit_bytes = one layer's
    slice of a block, the decode side grants the reserved blocks to the request key, the prefill side pushes layer
    slices under the key (no notification), then whole blocks, then notifies with the key."""
    layers, unit = 4, BB // 4

    async def main():
        dec, pd, _ = local_agent(name="decode", unit=unit, **kw(transport), **GRANTS)
        pre, pp, rp = local_agent(name="prefill", unit=unit, **kw(transport), **GRANTS)
        pp.fill(3)
        await dec.start()
        peer = await pre.connect(dec.address)
        notes = []
        dec.on_notification(notes.append)
        dec.grant_blocks("req-1", "kv", [10, 11, 12, 30], BB, "w", time.time() + 60, peer="prefill")
        src, dst = np.array([0, 1, 2, 7]), np.array([10, 11, 12, 30])
        rr = pre.peer(peer).region_id("kv")
        for layer in range(layers):
            xl = XferList.build(rp, src * BB + layer * unit, rr, dst * BB + layer * unit, unit)
            await pre.write(peer, xl, None, coalesce=False, key="req-1")
        assert np.array_equal(pd.data[dst], pp.data[src]) and notes == []
        pp.fill(4)
        res = await pre.write_blocks(peer, src.tolist(), dst.tolist(), BB, rp, "kv", key="req-1")
        assert res.transport == transport and res.descs_out == 2
        await pre.notify(peer, {"request_id": "req-1", "first_token": 5}, key="req-1")
        n = await dec.wait_notification(timeout=10)
        assert n.key == "req-1" and n.error is None and n.payload_dict() == {"request_id": "req-1", "first_token": 5}
        assert np.array_equal(pd.data[dst], pp.data[src])
        dec.revoke("req-1")
        await pre.close()
        await dec.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_threaded_agent_reports_the_transport_per_peer():
    from pdserve.kv import ThreadedAgent
    from tests.kv.kv_helpers import SECRET

    with ThreadedAgent(AgentConfig(name="d0", secret=SECRET)) as dec, \
            ThreadedAgent(AgentConfig(name="p0", secret=SECRET)) as pre:
        for ag in (dec, pre):
            ag.register(np.zeros(4096, np.uint8), name="kv")
        peer = pre.connect(dec.address)
        # host memory on both sides: tcp, and no faster transport this process started could have served
        assert pre.peer_transports() == {peer: {"transport": "tcp", "unavailable": {}}}

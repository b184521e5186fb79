"""Failure behaviour: a peer killed or hung mid-transfer fails the transfer within a bounded time on the sender, a
receiver waiting on a dead sender is told, regions stay valid and are released exactly once."""

import asyncio
import hashlib
import os
import signal
import time

import numpy as np
import pytest

from pdserve.kv import (
    AgentConfig,
    KVAgent,
    KVTransferError,
    PeerDisconnectedError,
    RegionError,
    TransferTimeoutError,
)
from tests.kv.kv_helpers import BIG, OPEN, big_peer, local_agent, spawn_peer
from tests.kv.kv_helpers import xfer as _x


def big_agent(io_timeout: float) -> tuple[KVAgent, np.ndarray, int]:
    buf = np.random.default_rng(0).integers(0, 256, BIG, dtype=np.uint8)
    agent = KVAgent(AgentConfig(transport="tcp", io_timeout_s=io_timeout, tcp_connections=2, **OPEN))
    return agent, buf, agent.register(buf, name="big")


@pytest.mark.timeout(90)
def test_peer_killed_mid_transfer_fails_fast_and_regions_stay_valid():
    victim, survivor = big_peer("victim"), big_peer("survivor")
    try:
        async def main():
            a, buf, rid = big_agent(io_timeout=20.0)  # the kill, not the io timeout, must end the transfer
            pv = await a.connect(victim.call("info")["address"])
            ps = await a.connect(survivor.call("info")["address"])
            rv, rs = a.peer(pv).region_id("kv"), a.peer(ps).region_id("kv")
            await a.write(pv, _x(rid, rv, 1 << 20))  # warm: data connections exist
            os.kill(victim.proc.pid, signal.SIGSTOP)  # it stops reading: the next write is surely mid-flight
            task = asyncio.create_task(a.write(pv, _x(rid, rv, BIG), notif=b"never"))
            await asyncio.sleep(0.5)
            assert not task.done()
            t0 = time.monotonic()
            os.kill(victim.proc.pid, signal.SIGKILL)
            with pytest.raises(PeerDisconnectedError, match=r"peer victim at 127\.0\.0\.1:\d+"):
                await task
            assert time.monotonic() - t0 < 5.0
            with pytest.raises(PeerDisconnectedError, match="victim"):
                await a.write(pv, _x(rid, rv, 1024))
            # the region that was being sent is intact and serves the next transfer
            res = await a.write(ps, _x(rid, rs, BIG), notif=b"ok")
            assert res.nbytes == BIG
            assert survivor.call("checksums", ids=[0]) == [hashlib.blake2b(buf.tobytes(), digest_size=16).hexdigest()]
            a.deregister(rid)
            with pytest.raises(RegionError, match="deregistered twice"):
                a.deregister(rid)
            await a.close()
            await a.close()  # idempotent

        asyncio.run(main())
    finally:
        victim.proc.kill()
        survivor.close()


@pytest.mark.timeout(60)
def test_hung_peer_times_out_within_io_timeout():
    hung = big_peer("hung")
    try:
        async def main():
            a, buf, rid = big_agent(io_timeout=1.0)
            p = await a.connect(hung.call("info")["address"])
            rr = a.peer(p).region_id("kv")
            os.kill(hung.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="hung"):
                await a.write(p, _x(rid, rr, BIG))
            assert time.monotonic() - t0 < 4.0
            t0 = time.monotonic()
            with pytest.raises(TransferTimeoutError):
                await a.write(p, _x(rid, rr, BIG), timeout=0.5)
            assert time.monotonic() - t0 < 3.0
            await a.close()

        asyncio.run(main())
    finally:
        os.kill(hung.proc.pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_receiver_waiting_on_a_dead_sender_is_told():
    sender = spawn_peer("sender")
    try:
        async def main():
            b, pool, rb = local_agent()
            await b.start()
            loop = asyncio.get_running_loop()  # the call blocks: keep our loop free to answer the handshake
            name = await loop.run_in_executor(None, lambda: sender.call("connect", address=b.address))
            assert name == b.name
            await asyncio.sleep(0.2)  # let the handshake land on our side
            waiter = asyncio.create_task(b.wait_notification(peer="sender", timeout=30))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            sender.proc.kill()
            with pytest.raises(PeerDisconnectedError, match="sender"):
                await waiter
            assert time.monotonic() - t0 < 3.0
            with pytest.raises(TransferTimeoutError, match="within 0.2 s"):
                await b.wait_notification(timeout=0.2)
            await b.close()

        asyncio.run(main())
    finally:
        sender.proc.kill()

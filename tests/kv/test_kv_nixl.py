"""The nixl transport against a stand-in of the NIXL Python API (tests/kv/fake_nixl): handshake metadata,
registration, descriptor addresses and the completion polling, without NIXL installed."""

import asyncio
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.transfer_worker import Pool
from pdserve.kv import AgentConfig, KVAgent, XferList
from tests.kv.kv_helpers import BB, NB, OPEN


@pytest.fixture
def fake_nixl(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_nixl"))
    sys.modules.pop("nixl_cu13", None)
    mod = importlib.import_module("nixl_cu13")
    mod.PREPS.clear()
    yield mod
    sys.modules.pop("nixl_cu13", None)


@pytest.mark.timeout(60)
def test_nixl_transport_moves_blocks_and_notifies(fake_nixl):
    async def main():
        pa, pb = Pool(NB, BB, "numpy", "cpu"), Pool(NB, BB, "numpy", "cpu")
        pa.fill(3)
        a = KVAgent(AgentConfig(transport="nixl", name="na", **OPEN))
        b = KVAgent(AgentConfig(transport="nixl", name="nb", **OPEN))
        ra, rb = a.register(pa.data, "kv", unit_bytes=BB), b.register(pb.data, "kv", unit_bytes=BB)
        await b.start()
        peer = await a.connect(b.address)
        # prepared once per side: each agent's own pool at registration, and the peer's pool when its region table
        # arrived (both agents live in this process and share the stand-in's record), NB units each
        assert sorted(fake_nixl.PREPS) == sorted([("NIXL_INIT_AGENT", NB)] * 2 + [("na", NB), ("nb", NB)])
        preps = len(fake_nixl.PREPS)
        res = await a.write_blocks(peer, [5, 6, 7, 20], [40, 41, 42, 0], BB, ra, "kv", notif={"request_id": "x"})
        assert (res.transport, res.descs_in, res.descs_out) == ("nixl", 4, 2)
        assert np.array_equal(pb.data[[40, 41, 42, 0]], pa.data[[5, 6, 7, 20]])
        assert (await b.wait_notification(peer="na", timeout=5)).unpack() == {"request_id": "x"}
        pb.fill(9)
        await a.read_blocks(peer, [1, 2], [60, 61], BB, ra, rb)
        assert np.array_equal(pa.data[[60, 61]], pb.data[[1, 2]])
        assert fake_nixl.CALLS[-2:] == ["WRITE", "READ"]
        # per transfer only index lists: one per unit moved, and no descriptor list prepared
        assert fake_nixl.XFERS[-2:] == [(4, 4), (2, 2)] and len(fake_nixl.PREPS) == preps
        # a region registered after the handshake reaches the peer's NIXL agent through the region update;
        # without a unit its transfers prepare their own descriptor lists (the slow path), and still arrive
        extra = np.zeros(4096, dtype=np.uint8)
        rx = b.register(extra, "extra")
        for _ in range(100):
            if rx in a.peer(peer).regions and a.peer(peer).extra["nixl"]["meta"] == b.transports["nixl"]._nixl.get_agent_metadata():
                break
            await asyncio.sleep(0.01)
        await a.write(peer, XferList.build(ra, 0, rx, 0, 4096))
        assert np.array_equal(extra, pa.data.reshape(-1)[:4096])
        assert len(fake_nixl.PREPS) == preps + 3  # b's pool again (new metadata), then this transfer's two lists
        await a.close()
        await b.close()

    asyncio.run(main())


def test_unit_indices():
    from pdserve.kv.transports.nixl import unit_indices

    idx = unit_indices(np.array([3 * BB, 10 * BB]), np.array([2 * BB, 3 * BB]), BB)
    assert idx.dtype == np.int32 and idx.tolist() == [3, 4, 10, 11, 12]
    assert unit_indices(np.array([BB + 1]), np.array([BB]), BB) is None

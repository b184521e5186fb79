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
from tests.kv.kv_helpers import BB, NB


@pytest.fixture
def fake_nixl(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_nixl"))
    sys.modules.pop("nixl_cu13", None)
    mod = importlib.import_module("nixl_cu13")
    yield mod
    sys.modules.pop("nixl_cu13", None)


@pytest.mark.timeout(60)
def test_nixl_transport_moves_blocks_and_notifies(fake_nixl):
    async def main():
        pa, pb = Pool(NB, BB, "numpy", "cpu"), Pool(NB, BB, "numpy", "cpu")
        pa.fill(3)
        a = KVAgent(AgentConfig(transport="nixl", name="na"))
        b = KVAgent(AgentConfig(transport="nixl", name="nb"))
        ra, rb = a.register(pa.data, "kv"), b.register(pb.data, "kv")
        await b.start()
        peer = await a.connect(b.address)
        res = await a.write_blocks(peer, [5, 6, 7, 20], [40, 41, 42, 0], BB, ra, "kv", notif={"request_id": "x"})
        assert (res.transport, res.descs_in, res.descs_out) == ("nixl", 4, 2)
        assert np.array_equal(pb.data[[40, 41, 42, 0]], pa.data[[5, 6, 7, 20]])
        assert (await b.wait_notification(peer="na", timeout=5)).unpack() == {"request_id": "x"}
        pb.fill(9)
        await a.read_blocks(peer, [1, 2], [60, 61], BB, ra, rb)
        assert np.array_equal(pa.data[[60, 61]], pb.data[[1, 2]])
        assert fake_nixl.CALLS[-2:] == ["WRITE", "READ"]
        # a region registered after the handshake reaches the peer's NIXL agent through the region update
        extra = np.zeros(4096, dtype=np.uint8)
        rx = b.register(extra, "extra")
        for _ in range(100):
            if rx in a.peer(peer).regions and a.peer(peer).extra["nixl"]["meta"] == b.transports["nixl"]._nixl.get_agent_metadata():
                break
            await asyncio.sleep(0.01)
        await a.write(peer, XferList.build(ra, 0, rx, 0, 4096))
        assert np.array_equal(extra, pa.data.reshape(-1)[:4096])
        await a.close()
        await b.close()

    asyncio.run(main())

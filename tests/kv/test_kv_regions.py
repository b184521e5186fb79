"""Regions: what can be registered, and the engine's block-major torch KV pool moved block by block over tcp."""

import asyncio
import time

import numpy as np
import pytest
import torch

from pdserve.kv import AgentConfig, KVAgent, RegionError
from pdserve.kv.regions import RegionTable
from tests.kv.kv_helpers import OPEN


def test_region_kinds_and_errors():
    table = RegionTable()
    kv = torch.zeros(4, 3, 2, 16, 2, 8, dtype=torch.bfloat16)
    r = table.add(kv, "kv")
    assert (r.kind, r.device, r.size) == ("cpu", -1, kv.numel() * 2)
    r.host_view[0:2] = b"\x80\x3f"  # bf16 1.0, little endian: the view aliases the tensor's memory
    assert kv.reshape(-1)[0].item() == 1.0
    assert table.add(np.zeros(10, dtype=np.float32), None).size == 40
    with pytest.raises(RegionError, match="already registered"):
        table.add(bytearray(4), "kv")
    with pytest.raises(RegionError, match="contiguous"):
        table.add(torch.zeros(4, 4).t(), None)
    with pytest.raises(RegionError, match="writeable"):
        table.add(memoryview(b"abc"), None)
    table.remove(r.region_id)
    with pytest.raises(RegionError, match="deregistered twice"):
        table.remove(r.region_id)
    assert table.by_name("region2").size == 40


@pytest.mark.timeout(60)
def test_block_major_torch_pool_blocks_move_exactly():
    shape = (32, 4, 2, 16, 2, 64)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

    async def main():
        secret = OPEN["secret"]
        prefill = KVAgent(AgentConfig(transport="tcp", secret=secret))
        decode = KVAgent(AgentConfig(transport="tcp", secret=secret))
        kv_p = torch.randn(shape, dtype=torch.bfloat16)
        kv_d = torch.zeros(shape, dtype=torch.bfloat16)
        rp, _ = prefill.register(kv_p, "kv"), decode.register(kv_d, "kv")
        await decode.start()
        peer = await prefill.connect(decode.address)
        block_bytes = kv_p[0].numel() * kv_p.element_size()
        src, dst = [3, 4, 5, 9, 0], [10, 11, 12, 1, 31]
        decode.grant_blocks("abc", "kv", dst, block_bytes, "w", time.time() + 30, peer=prefill.name)
        res = await prefill.write_blocks(peer, src, dst, block_bytes, rp, "kv", notif={"request_id": "abc"}, key="abc")
        assert (res.descs_in, res.descs_out) == (5, 3)  # 3,4,5 -> 10,11,12 became one descriptor
        note = await decode.wait_notification(peer=prefill.name, timeout=5)
        assert note.unpack()["request_id"] == "abc" and note.key == "abc"
        assert torch.equal(kv_d[dst], kv_p[src])
        others = [i for i in range(shape[0]) if i not in dst]
        assert not kv_d[others].any()
        await prefill.close()
        await decode.close()

    asyncio.run(main())

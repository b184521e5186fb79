"""fp8 KV pools in the torch reference backend: it stores k / k_scale in the pool's fp8 dtype and reads
stored * k_scale, so attention over the pool equals attention over a full-precision pool holding the same quantized
values; its forward, as the Triton backend's, gives rows with more than one new token their own K/V unquantized."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops.attention import AttentionMetadata
from pdserve.ops.attention.torch_ref import TorchAttentionBackend, write_kv

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _quantized(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() / scale).to(dtype).float() * scale


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("decode_only", [True, False])
def test_fp8_pool_equals_a_float_pool_of_the_quantized_values(fp8, decode_only):
    g = torch.Generator().manual_seed(3)
    nb, bs, hq, hk, d = 12, 4, 4, 2, 32
    ks, vs = torch.tensor(0.37), torch.tensor(2.5)
    seq_lens = [9, 5, 1] if decode_only else [9, 6, 3]
    new = [1, 1, 1] if decode_only else [1, 6, 2]  # a decode row, a whole prompt, a chunk after a prefix hit
    tables = torch.tensor([[0, 1, 2], [3, 4, -1], [5, -1, -1]], dtype=torch.int32)
    old = {i: torch.randn((seq_lens[i] - new[i], 2, hk, d), generator=g) for i in range(3)}
    pool8 = torch.zeros((nb, 2, bs, hk, d), dtype=fp8)
    pool32 = torch.zeros((nb, 2, bs, hk, d))
    for i in range(3):  # tokens already in the pool
        pos = torch.arange(seq_lens[i] - new[i])
        slots = tables[i][pos // bs].long() * bs + pos % bs
        write_kv(pool8, old[i][:, 0], old[i][:, 1], slots, ks, vs)
        write_kv(pool32, _quantized(old[i][:, 0], ks, fp8), _quantized(old[i][:, 1], vs, fp8), slots)
    t = sum(new)
    q, k, v = (torch.randn((t, h, d), generator=g) for h in (hq, hk, hk))
    qsl = [0, new[0], new[0] + new[1], t]
    slots = torch.cat([tables[i][torch.arange(seq_lens[i] - new[i], seq_lens[i]) // bs].long() * bs
                       + torch.arange(seq_lens[i] - new[i], seq_lens[i]) % bs for i in range(3)])
    meta = AttentionMetadata(qsl, seq_lens, tables, slots, max(seq_lens), decode_only)
    be = TorchAttentionBackend()
    fwd8 = be.forward(q, k, v, pool8, meta, d**-0.5, k_scale=ks, v_scale=vs)
    write_kv(pool32, _quantized(k, ks, fp8), _quantized(v, vs, fp8), slots)
    out8 = be.attend(q, pool8, meta, d**-0.5, k_scale=ks, v_scale=vs)
    out32 = be.attend(q, pool32, meta, d**-0.5)
    torch.testing.assert_close(out8, out32, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fwd8, be.attend(q, pool32, meta, d**-0.5, k_new=k, v_new=v), atol=1e-5, rtol=1e-5)
    assert torch.equal(pool8.float() * torch.stack([ks, vs]).view(1, 2, 1, 1, 1), pool32), "stored = x / scale"

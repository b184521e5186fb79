"""The Triton paged-decode kernel against the torch reference: random pools, random block tables, GQA, sliding
windows, ragged sequence lengths. CUDA only (Triton's CPU interpreter cannot run data-dependent loop bounds)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")


def _device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,d,window", [(8, 2, 64, None), (4, 1, 32, 24), (32, 8, 128, None)])
def test_paged_decode_matches_reference(hq, hk, d, window):
    from pdserve.ops.attention import AttentionMetadata, TorchAttentionBackend
    from pdserve.ops.triton_attention import paged_decode

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(hq * 7 + d)
    nb, bs, layers = 96, 16, 2
    pool = torch.randn((nb, layers, 2, bs, hk, d), generator=g).to(dev, dtype)
    seq_lens = [1, 17, 130, 300, 45]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for n in seq_lens:
        k = (n + bs - 1) // bs
        tables.append(perm[used:used + k] + [-1] * (20 - k))
        used += k
    bt = torch.tensor(tables, dtype=torch.int32, device=dev)
    q = torch.randn((len(seq_lens), hq, d), generator=g).to(dev, dtype)
    layer = pool[:, 1]
    scale = d ** -0.5
    out = paged_decode(q, layer, bt, torch.tensor(seq_lens, dtype=torch.int32, device=dev), max(seq_lens), scale, window)
    # the reference, with its own write of no new tokens: slot mapping empty, compare attention only
    meta = AttentionMetadata(list(range(len(seq_lens) + 1)), seq_lens, bt, torch.empty(0, dtype=torch.long, device=dev),
                             max(seq_lens), True)
    ref = TorchAttentionBackend._decode_batched(q.float(), layer.float(), meta, scale, window)
    err = (out.float() - ref).norm() / ref.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), float(err)

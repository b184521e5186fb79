"""The Triton backend's forward (write, then decode and prefill kernels) against the torch backend's forward on
mixed batches: decode rows, whole prompts, chunks on prefixes, in one call. Outputs must agree and the pools must be
identical afterwards (fp8 pools: bitwise on CUDA). Padded (CUDA-graph style) metadata, hand-built metadata, and on
CUDA: capture of one forward in a CUDA graph and replays with other batches than the captured one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.ops.attention import AttentionMetadata, AttentionMetadataBuilder, get_backend, max_prefill_tiles
from pdserve.ops.attention.common import as_storage, is_fp8
from pdserve.ops.attention.torch_ref import TorchAttentionBackend, write_kv
from pdserve.ops.attention.triton_backend import TritonAttentionBackend
from tests.ops.attention_helpers import DEVICE, assert_close, gpu, make_problem

MIXED = ([40, 1, 150, 60, 130, 200], [40, 1, 1, 30, 130, 1])


def _both(p, dtype, scale, window=None, softcap=None):
    """(triton out, torch out) of a forward on two copies of the pool; the pools must come out equal."""
    a, b = p.fresh_layer(), p.fresh_layer()
    ref = TorchAttentionBackend().forward(p.q.float(), p.k, p.v, a, p.meta, scale, window, softcap, p.k_scale,
                                          p.v_scale)
    out = TritonAttentionBackend().forward(p.q, p.k, p.v, b, p.meta, scale, window, softcap, p.k_scale, p.v_scale)
    assert torch.equal(as_storage(a), as_storage(b)), "pools differ after the KV write"
    t = p.meta.query_start_loc[-1]
    assert_close(out[:t], ref[:t], dtype, f"forward window={window} softcap={softcap}")
    return out, ref


@pytest.mark.parametrize("hq,hk,d,bs,dtype,window,softcap", [
    (4, 1, 64, 16, torch.float32, None, None),
    (8, 8, 32, 32, torch.float16, 60, None),
    (8, 1, 64, 16, torch.float32, None, 10.0),
])
def test_mixed_forward_matches_torch_backend(hq, hk, d, bs, dtype, window, softcap):
    p = make_problem(*MIXED, hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, seed=d + hq)
    _both(p, dtype, d ** -0.5, window, softcap)


def test_decode_only_forward_matches_torch_backend():
    p = make_problem([3, 90, 16, 17], [1, 1, 1, 1], hq=8, hk=2, d=64, bs=16, seed=1)
    assert p.meta.decode_only
    _both(p, torch.float32, 0.125)


def test_padded_metadata_matches_unpadded():
    pad = {"num_tokens": 256, "num_seqs": 10, "num_tiles": 8, "max_seq_len": 2048}
    p = make_problem(*MIXED, hq=4, hk=2, d=32, bs=16, seed=9, pad=pad)
    out, _ = _both(p, torch.float32, 0.2)
    # the real rows match (in _both) and are finite; padded token rows are left unwritten (torch.empty: whatever the
    # allocator held), as the runner discards them; asserting them finite made this test depend on that memory
    assert torch.isfinite(out[: p.meta.query_start_loc[-1]]).all()


def test_hand_built_metadata_works():
    p = make_problem(*MIXED, hq=4, hk=2, d=32, bs=16, seed=2)
    m = p.meta
    p.meta = AttentionMetadata(m.query_start_loc, m.seq_lens, m.block_tables, m.slot_mapping, m.max_seq_len, False)
    _both(p, torch.float32, 0.2)


@pytest.mark.parametrize("new", [False, True])
def test_fp8_pool_attend_matches_torch_backend(new):
    # on CPU the interpreter's fp32 -> fp8 rounding differs from torch: write with the reference, attend with both
    # (new: prefill rows read their new tokens' K/V from k/v, unquantized, as forward has them do)
    p = make_problem(*MIXED, hq=8, hk=2, d=64, bs=16, kv_dtype=torch.float8_e4m3fn, seed=3)
    layer = p.fresh_layer()
    write_kv(layer, p.k, p.v, p.meta.slot_mapping, p.k_scale, p.v_scale)
    own = dict(k_new=p.k, v_new=p.v) if new else {}
    ref = TorchAttentionBackend().attend(p.q, layer, p.meta, 0.125, None, None, p.k_scale, p.v_scale, **own)
    out = TritonAttentionBackend().attend(p.q, layer, p.meta, 0.125, None, None, p.k_scale, p.v_scale, **own)
    assert_close(out, ref, torch.float32, f"fp8 attend new={new}")


def test_get_backend_returns_triton_by_name():
    assert get_backend("triton", DEVICE).name == "triton"
    if DEVICE.type == "cuda":
        assert get_backend("auto", DEVICE).name == "triton"


@gpu
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                            (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)])
@pytest.mark.parametrize("hq,hk,d,window", [(32, 8, 128, None), (8, 4, 256, 512), (64, 8, 128, None)])
def test_mixed_forward_matches_torch_backend_cuda(dtype, kv_dtype, hq, hk, d, window):
    lens = [8704, 1, 300, 4000, 2048] + [1500] * 30
    qlens = [512, 1, 1, 4000, 17] + [1] * 30
    p = make_problem(lens, qlens, hq=hq, hk=hk, d=d, bs=16, dtype=dtype, kv_dtype=kv_dtype, seed=5)
    _both(p, dtype, d ** -0.5, window)


def _step(rng, max_len, n_decode, prefills):
    """(seq_lens, q_lens) of a random step: n_decode decode rows and prefill rows of the given new-token counts."""
    lens, qlens = [], []
    for _ in range(n_decode):
        lens.append(int(rng.integers(1, max_len)))
        qlens.append(1)
    for q in prefills:
        lens.append(int(rng.integers(q, max_len)))
        qlens.append(q)
    order = rng.permutation(len(lens))
    return [lens[i] for i in order], [qlens[i] for i in order]


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_forward_replays_in_a_cuda_graph(kv_dtype):
    """One capture at padded sizes (256 tokens, 16 rows, up to 4 prefill rows); replays with other mixes."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    hq, hk, d, bs, max_len = 32, 8, 128, 16, 4096
    t_pad, b_pad, max_pre = 256, 16, 4
    width = max_len // bs
    builder = AttentionMetadataBuilder(dev, t_pad, b_pad, width, max_prefill_seqs=max_pre, static=True)
    pad = {"num_tokens": t_pad, "num_seqs": b_pad, "num_tiles": max_prefill_tiles(t_pad, max_pre),
           "max_seq_len": max_len}
    nb = b_pad * width + 1
    pool = torch.randn((nb, 1, 2, bs, hk, d), device=dev).to(kv_dtype)
    layer = pool[:, 0]
    ks = torch.tensor(0.7, device=dev) if is_fp8(kv_dtype) else None
    vs = torch.tensor(1.3, device=dev) if is_fp8(kv_dtype) else None
    sq, sk, sv = (torch.zeros((t_pad, h, d), dtype=dtype, device=dev) for h in (hq, hk, hk))
    rng = np.random.default_rng(0)
    perm = rng.permutation(nb - 1)

    def make(lens, qlens):
        tables = [perm[i * width: i * width + -(-n // bs)].tolist() for i, n in enumerate(lens)]
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, qlens)])
        row = np.repeat(np.arange(len(lens)), qlens)
        tab = np.array([tables[r][p // bs] for r, p in zip(row, pos)])
        return builder.build(qsl, lens, tables, tab * bs + pos % bs, **pad)

    backend = TritonAttentionBackend()
    meta = make(*_step(rng, max_len, 6, [100, 40]))
    for x in (sq, sk, sv):
        x.normal_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(sq, sk, sv, layer, meta, d ** -0.5, None, None, ks, vs)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(sq, sk, sv, layer, meta, d ** -0.5, None, None, ks, vs)
    for n_dec, prefills in [(10, [200]), (16, []), (0, [128, 64, 30, 2]), (12, [1, 3]), (3, [250])]:
        lens, qlens = _step(rng, max_len, n_dec, prefills)
        meta = make(lens, qlens)
        t = int(sum(qlens))
        for x in (sq, sk, sv):
            x.normal_()
        ref_layer = pool.clone()[:, 0]
        ref = TorchAttentionBackend().forward(sq[:t].float(), sk[:t], sv[:t], ref_layer, meta, d ** -0.5, None,
                                              None, ks, vs)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(as_storage(layer), as_storage(ref_layer)), "graph replay wrote the pool differently"
        assert_close(out[:t], ref, dtype, f"graph replay {n_dec} decodes + {prefills}")

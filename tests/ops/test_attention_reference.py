"""The torch reference backend (the oracle of every kernel) against a dense float64 attention written from scratch:
per row, per head, K/V picked token by token through the block table, explicit causal / window masks, softcap.
Also the reference's KV write: slots, skipped slots, fp8 quantization with scales and saturation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pdserve.ops.attention.common import fp8_max
from pdserve.ops.attention.torch_ref import TorchAttentionBackend, dequantize, quantize_fp8, write_kv
from tests.ops.attention_helpers import make_problem


def _dense(p, scale, window, softcap, kv_layer, own=True):
    """float64 attention of every new token of the problem, reading the pool slot by slot; own: rows with more than
    one new token take their new tokens' K/V from p.k/p.v instead (the backends' forward does; for an fp8 pool the
    pool's copy is quantized)."""
    meta = p.meta
    qsl, bs = meta.query_start_loc, kv_layer.shape[2]
    hq, hk = p.q.shape[1], kv_layer.shape[3]
    out = torch.zeros(p.q.shape, dtype=torch.float64)
    ks = p.k_scale.double() if p.k_scale is not None else 1.0
    vs = p.v_scale.double() if p.v_scale is not None else 1.0
    for i, seq_len in enumerate(meta.seq_lens):
        kk = torch.stack([kv_layer[p.tables[i][j // bs], 0, j % bs].double() for j in range(seq_len)]) * ks
        vv = torch.stack([kv_layer[p.tables[i][j // bs], 1, j % bs].double() for j in range(seq_len)]) * vs
        n_new = qsl[i + 1] - qsl[i]
        if own and n_new > 1:
            kk[seq_len - n_new:] = p.k[qsl[i]: qsl[i + 1]].double()
            vv[seq_len - n_new:] = p.v[qsl[i]: qsl[i + 1]].double()
        for t in range(qsl[i], qsl[i + 1]):
            pos = seq_len - (qsl[i + 1] - t)
            for h in range(hq):
                s = (kk[:, h // (hq // hk)] @ p.q[t, h].double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                j = torch.arange(seq_len)
                ok = j <= pos
                if window is not None:
                    ok &= pos - j < window
                s = s.masked_fill(~ok, -math.inf)
                out[t, h] = torch.softmax(s, 0) @ vv[:, h // (hq // hk)]
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (9, 2.0)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_reference_matches_dense(window, softcap, kv_dtype):
    p = make_problem([19, 1, 40, 33, 7], [19, 1, 12, 1, 3], hq=4, hk=2, d=16, bs=8, kv_dtype=kv_dtype, seed=3)
    layer = p.fresh_layer()
    out = TorchAttentionBackend().forward(p.q, p.k, p.v, layer, p.meta, 0.3, window, softcap, p.k_scale, p.v_scale)
    ref = _dense(p, 0.3, window, softcap, layer.cpu())
    assert (out.double() - ref).abs().max() < 1e-4
    pool_only = TorchAttentionBackend().attend(p.q, layer, p.meta, 0.3, window, softcap, p.k_scale, p.v_scale)
    assert (pool_only.double() - _dense(p, 0.3, window, softcap, layer.cpu(), own=False)).abs().max() < 1e-4


def test_reference_decode_only_batched_path_matches_dense():
    p = make_problem([19, 1, 40, 33], [1, 1, 1, 1], hq=8, hk=1, d=16, bs=4, seed=5)
    assert p.meta.decode_only
    for window in (None, 6):
        layer = p.fresh_layer()
        out = TorchAttentionBackend().forward(p.q, p.k, p.v, layer, p.meta, 0.25, window)
        assert (out.double() - _dense(p, 0.25, window, None, layer.cpu())).abs().max() < 1e-5


def test_write_kv_places_tokens_by_slot_and_skips_negative_slots():
    pool = torch.randn(6, 2, 4, 3, 8)
    before = pool.clone()
    k, v = torch.randn(3, 3, 8), torch.randn(3, 3, 8)
    slots = torch.tensor([9, -1, 22])  # block 2 offset 1; skipped; block 5 offset 2
    write_kv(pool, k, v, slots)
    assert torch.equal(pool[2, 0, 1], k[0]) and torch.equal(pool[2, 1, 1], v[0])
    assert torch.equal(pool[5, 0, 2], k[2]) and torch.equal(pool[5, 1, 2], v[2])
    touched = torch.zeros(6, 4, dtype=torch.bool)
    touched[2, 1] = touched[5, 2] = True
    assert torch.equal(pool.permute(0, 2, 1, 3, 4)[~touched], before.permute(0, 2, 1, 3, 4)[~touched])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_divides_by_scale_and_saturates(dtype):
    pool = torch.zeros(2, 2, 4, 1, 4, dtype=dtype)
    m = fp8_max(dtype)
    k = torch.tensor([[[1.0, -3.0, 10 * m, -10 * m]]])
    v = torch.tensor([[[0.5, 2.0, 5 * m, float(m)]]])
    ks, vs = torch.tensor(2.0), torch.tensor(4.0)
    write_kv(pool, k, v, torch.tensor([5]), ks, vs)
    stored_k = pool[1, 0, 1, 0].float()
    stored_v = pool[1, 1, 1, 0].float()
    assert stored_k.tolist() == [0.5, -1.5, m, -m]
    assert stored_v.tolist() == [0.125, 0.5, m, float(torch.tensor(m / 4).to(dtype).float())]
    assert torch.equal(dequantize(pool[1, 0, 1, 0], torch.float32, ks), stored_k * 2.0)


def test_quantize_rounds_to_nearest_even_like_torch():
    x = torch.randn(1000) * 50
    q = quantize_fp8(x, torch.float8_e4m3fn, torch.tensor(0.25))
    assert torch.equal(q.float(), (x / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert np.isfinite(q.float().numpy()).all()


def test_reference_splits_long_queries_without_changing_results(monkeypatch):
    from pdserve.ops.attention import torch_ref

    p = make_problem([70, 45], [70, 20], hq=4, hk=2, d=16, bs=8, seed=8)
    layer = p.fresh_layer()
    whole = TorchAttentionBackend().forward(p.q, p.k, p.v, layer, p.meta, 0.3, 11)
    monkeypatch.setattr(torch_ref, "_SCORES_PER_CALL", 4 * 70 * 3)  # three queries per call
    split = TorchAttentionBackend().attend(p.q, layer, p.meta, 0.3, 11)
    assert (whole - split).abs().max() < 1e-6

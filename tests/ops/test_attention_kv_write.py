"""The reshape-and-cache kernel against the reference write: every pool byte equal afterwards (written slots and
untouched ones), k/v as strided views of a fused projection, skipped slots, fp8 quantization with scales.

Triton's CPU interpreter rounds fp32 -> fp8 differently from the hardware (and from torch), so fp8 writes are
checked on CUDA only; fp8 *reads* are covered on CPU by the decode and prefill tests."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops.attention.common import as_storage, fp8_max
from pdserve.ops.attention.kv_write import write_kv
from pdserve.ops.attention.torch_ref import write_kv as write_kv_ref
from tests.ops.attention_helpers import DEVICE, gpu, make_problem


def _check(p):
    a, b = p.fresh_layer(), p.fresh_layer()
    before = a.clone()
    write_kv_ref(a, p.k, p.v, p.meta.slot_mapping, p.k_scale, p.v_scale)
    write_kv(b, p.k, p.v, p.meta.slot_mapping, p.k_scale, p.v_scale)
    assert not torch.equal(as_storage(a), as_storage(before))  # the reference wrote something
    assert torch.equal(as_storage(a), as_storage(b))


@pytest.mark.parametrize("hk,d,bs,dtype", [(2, 64, 16, torch.float32), (1, 128, 32, torch.float16),
                                           (3, 48, 16, torch.float16)])
def test_write_matches_reference(hk, d, bs, dtype):
    p = make_problem([21, 40, 3], [21, 7, 1], hq=2 * hk, hk=hk, d=d, bs=bs, dtype=dtype, seed=d)
    _check(p)


def test_padded_tokens_are_skipped():
    p = make_problem([30, 5], [10, 1], hq=4, hk=2, d=32, bs=16, pad={"num_tokens": 16, "num_seqs": 4})
    assert (p.meta.slot_mapping[11:] == -1).all()
    _check(p)


@gpu
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
                                            (torch.float16, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fn)])
@pytest.mark.parametrize("hk,d,bs", [(8, 128, 16), (4, 256, 32), (1, 64, 16)])
def test_write_matches_reference_cuda(dtype, kv_dtype, hk, d, bs):
    p = make_problem([900, 37, 1, 2048], [900, 1, 1, 512], hq=4 * hk, hk=hk, d=d, bs=bs, dtype=dtype,
                     kv_dtype=kv_dtype, seed=bs + d)
    _check(p)


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_saturates_cuda(kv_dtype):
    pool = torch.zeros(4, 2, 16, 2, 64, dtype=kv_dtype, device=DEVICE)
    m = fp8_max(kv_dtype)
    k = torch.linspace(-4 * m, 4 * m, 3 * 2 * 64, device=DEVICE).view(3, 2, 64)
    v = -k
    slots = torch.tensor([0, 17, 63], device=DEVICE)
    scale = torch.tensor(1.5, device=DEVICE)
    write_kv(pool, k, v, slots, scale, scale)
    ref = torch.zeros_like(pool)
    write_kv_ref(ref, k, v, slots, scale, scale)
    assert torch.isfinite(pool.float()).all()
    assert torch.equal(as_storage(pool), as_storage(ref))
    assert pool.float().abs().max() == m

"""RMS norm kernels (plain, fused with the residual add, final norm of gathered rows) against their torch
references on fresh random data, odd sizes included (hidden 640 as Gemma 3 270M)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_cases import DEVICE_DTYPES, assert_close, gen, randn

pytest.importorskip("triton")

from pdserve.ops.norm import (  # noqa: E402
    add_rms_norm_rows_triton,
    final_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)

SHAPES = [(1, 640), (3, 64), (257, 640), (5, 4096), (2, 96)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(device, dtype, tokens, hidden, offset):
    g = gen(tokens * 131 + hidden)
    x = randn((tokens, hidden), g, device, dtype, 3.0)
    w = randn((hidden,), g, device, dtype, 0.5)
    assert_close(rms_norm_triton(x, w, 1e-6, offset), rms_norm_ref(x, w, 1e-6, offset))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_add_rms_norm(device, dtype, tokens, hidden, offset):
    g = gen(tokens * 7 + hidden)
    x = randn((tokens, hidden), g, device, dtype, 2.0)
    res = randn((tokens, hidden), g, device, dtype, 5.0)
    w = randn((hidden,), g, device, dtype, 0.5)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5, offset)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5, offset)
    assert torch.equal(new_res, ref_res), "the residual is the model-dtype sum, bit for bit"
    assert_close(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must stay untouched"


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_final_norm_of_gathered_rows(device, dtype, with_residual):
    g = gen(11)
    tokens, hidden = 37, 640
    x = randn((tokens, hidden), g, device, dtype, 2.0)
    res = randn((tokens, hidden), g, device, dtype, 2.0) if with_residual else None
    w = randn((hidden,), g, device, dtype, 0.5)
    rows = torch.tensor([36, 0, 5, 5, 17], device=device)
    full = rms_norm_ref(x if res is None else x + res, w, 1e-6, 1.0)
    assert_close(add_rms_norm_rows_triton(x, res, w, 1e-6, 1.0, rows), full[rows])
    assert_close(final_rms_norm(x, res, w, 1e-6, 1.0, rows), full[rows])  # the dispatcher's reference path


def test_strided_rows_are_read_through_their_stride():
    g = gen(3)
    base = randn((9, 200), g, "cpu", torch.float32)
    x = base[:, 8:136]  # rows 200 apart, 128 wide
    w = randn((128,), g, "cpu", torch.float32)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def test_a_wrong_weight_is_caught():
    """The comparison can fail: a kernel fed another weight differs from the reference."""
    g = gen(5)
    x = randn((4, 64), g, "cpu", torch.float32)
    w = randn((64,), g, "cpu", torch.float32)
    with pytest.raises(AssertionError):
        assert_close(rms_norm_triton(x, w + 0.01, 1e-6), rms_norm_ref(x, w, 1e-6))

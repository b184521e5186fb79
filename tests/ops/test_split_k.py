"""Products split over K (pdserve.ops.split_k): the float32 parts sum to the product, the add+RMSNorm kernels that
take them give what the reference gives on the summed product, and the measured table's row ranges pick the
split."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.ops.kernel_cases import DEVICE_DTYPES, assert_close, gen, randn

pytest.importorskip("triton")

from pdserve.ops import split_k  # noqa: E402
from pdserve.ops.norm import (  # noqa: E402
    add_rms_norm_rows_triton,
    final_rms_norm,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from pdserve.ops.split_k import PartialSums, linear_parts, parts_in, split_linear  # noqa: E402


def _parts(n_parts, tokens, hidden, g, device, dtype) -> PartialSums:
    return PartialSums(randn((n_parts, tokens, hidden), g, device, torch.float32, 2.0), dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n_parts", [2, 3, 4])
@pytest.mark.parametrize("tokens,hidden", [(1, 640), (5, 4096), (33, 96)])
def test_norm_sums_the_parts_then_adds_the_residual(device, dtype, n_parts, tokens, hidden):
    g = gen(n_parts * 1000 + tokens + hidden)
    x = _parts(n_parts, tokens, hidden, g, device, dtype)
    res = randn((tokens, hidden), g, device, dtype, 5.0)
    w = randn((hidden,), g, device, dtype, 0.5)
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x.total(), res, w, 1e-5)
    assert out.dtype == dtype and new_res.dtype == dtype and out.shape == (tokens, hidden)
    if n_parts == 2:  # p0 + p1 in float32 is one rounding either way, then the same two roundings as the reference
        assert torch.equal(new_res, ref_res)
    else:
        assert_close(new_res, ref_res)
    assert_close(out, ref_out)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_norm_without_residual_and_of_gathered_rows(device, dtype):
    g = gen(21)
    tokens, hidden = 37, 640
    x = _parts(2, tokens, hidden, g, device, dtype)
    res = randn((tokens, hidden), g, device, dtype, 2.0)
    w = randn((hidden,), g, device, dtype, 0.5)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x.total(), w, 1e-6))
    rows = torch.tensor([36, 0, 5, 5, 17], device=device)
    full = rms_norm_ref(x.total() + res, w, 1e-6)
    assert_close(add_rms_norm_rows_triton(x, res, w, 1e-6, 0.0, rows), full[rows])
    assert_close(final_rms_norm(x, res, w, 1e-6, 0.0, rows), full[rows])  # the dispatcher (reference on CPU)


def test_reference_path_takes_partial_sums():
    g = gen(4)
    x = _parts(2, 3, 64, g, "cpu", torch.float32)
    res = randn((3, 64), g, "cpu", torch.float32)
    w = randn((64,), g, "cpu", torch.float32)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x.parts[0] + x.parts[1], res, w, 1e-6)
    assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)


def test_a_missing_part_is_caught():
    """The comparison can fail: the kernel given one part fewer differs from the reference on all of them."""
    g = gen(6)
    x = _parts(3, 4, 64, g, "cpu", torch.float32)
    res = randn((4, 64), g, "cpu", torch.float32)
    w = randn((64,), g, "cpu", torch.float32)
    out, _ = fused_add_rms_norm_triton(PartialSums(x.parts[:2], torch.float32), res, w, 1e-6)
    with pytest.raises(AssertionError):
        assert_close(out, fused_add_rms_norm_ref(x.total(), res, w, 1e-6)[0])


@pytest.mark.parametrize("n_parts", [2, 3, 4])
def test_split_products_sum_to_the_product(n_parts):
    g = gen(n_parts)
    x = randn((7, 96), g, "cpu", torch.float16)
    w = randn((40, 96), g, "cpu", torch.float16, 0.1)
    p = split_linear(x[:, :], w, n_parts)
    assert p.parts.shape == (n_parts, 7, 40) and p.parts.dtype == torch.float32 and p.dtype == torch.float16
    ref = x.float() @ w.float().t()
    torch.testing.assert_close(p.parts.sum(0), ref, rtol=1e-5, atol=1e-5)
    for i in range(n_parts):  # each part is its own slice of K
        ks = 96 // n_parts
        torch.testing.assert_close(p.parts[i], x[:, i * ks:(i + 1) * ks].float() @ w[:, i * ks:(i + 1) * ks].float().t(),
                                   rtol=1e-5, atol=1e-5)


def test_split_of_a_row_slice_reads_its_own_rows():
    g = gen(8)
    big = randn((10, 64), g, "cpu", torch.float32)
    w = randn((16, 64), g, "cpu", torch.float32)
    p = split_linear(big[3:8], w, 2)
    torch.testing.assert_close(p.parts.sum(0), big[3:8] @ w.t(), rtol=1e-5, atol=1e-5)


def test_table_row_ranges():
    table = {(4096, 4096): [(128, 384, 2)], (4096, 12288): [(96, 160, 3), (176, 448, 2)]}
    assert parts_in(table, 4096, 4096, 127) == 1
    assert parts_in(table, 4096, 4096, 128) == 2 and parts_in(table, 4096, 4096, 384) == 2
    assert parts_in(table, 4096, 4096, 385) == 1
    assert parts_in(table, 4096, 12288, 100) == 3 and parts_in(table, 4096, 12288, 170) == 1
    assert parts_in(table, 4096, 12288, 256) == 2
    assert parts_in(table, 6144, 4096, 256) is None  # no entry: the next table decides
    assert parts_in({(10, 9): [(1, 8, 2)]}, 10, 9, 4) == 1  # K not divisible by the count: not split


def test_table_file_and_cpu_rows(tmp_path, monkeypatch):
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"_source": "a test", "64,96": [[4, 8, 2]]}))
    split_k._load_table.cache_clear()
    split_k._parts.cache_clear()
    assert split_k._parts(64, 96, 6, 0, str(path)) == 2  # the file's entry answers without the GPU's table
    assert split_k._parts(64, 96, 9, 0, str(path)) == 1
    monkeypatch.setenv("PDSERVE_SPLIT_K_CONFIG", str(path))
    assert split_k.split_parts(64, 96, 6, torch.device("cpu")) == 1  # CPU tensors: never split
    x, w = torch.randn(6, 96), torch.randn(64, 96)
    out = linear_parts(x, w)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 96, 256])
def test_cuda_parts_are_the_unrounded_product(dtype, rows):
    """cuBLAS's float32 parts of 16-bit inputs: their sum rounded once is the plain product up to one rounding."""
    g = gen(rows)
    x = randn((rows, 4096), g, "cuda", dtype)
    w = randn((1024, 4096), g, "cuda", dtype, 4096 ** -0.5)
    ref = x.float() @ w.float().t()
    for s in (2, 4):
        p = split_linear(x, w, s)
        assert p.parts.dtype == torch.float32 and p.parts.shape == (s, rows, 1024)
        torch.testing.assert_close(p.parts.sum(0), ref, rtol=1e-3, atol=1e-3)
        assert_close(p.total(), F.linear(x, w))

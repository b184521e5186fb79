"""The add+RMSNorm folded into the one-row products around it (pdserve.ops.norm_fold): the producing product's
residual stream bit for bit as the add+RMSNorm kernel writes it, its h * w and partial sums of squares; the
consuming product against the norm's kernel followed by the product; the fallbacks."""

from __future__ import annotations

import json

import pytest
import torch

from tests.ops.kernel_cases import TOL, GridSpy, gen, randn

pytest.importorskip("triton")

from pdserve.ops import norm_fold as nf  # noqa: E402
from pdserve.ops.activation import act_and_mul_triton  # noqa: E402
from pdserve.ops.dispatch import force_fused  # noqa: E402
from pdserve.ops.linear import SkinnyConfig, skinny_act_linear, skinny_linear  # noqa: E402
from pdserve.ops.norm import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [pytest.param("cpu", dt, id=f"cpu-{str(dt)[6:]}") for dt in (torch.float16,)] + [
    pytest.param("cuda", dt, id=f"cuda-{str(dt)[6:]}", marks=[pytest.mark.gpu, _needs_cuda])
    for dt in (torch.bfloat16, torch.float16)]


class _Norm:
    def __init__(self, weight, eps=1e-6, offset=0.0):
        self.weight, self.eps, self.offset = weight, eps, offset


@pytest.fixture
def tiles(tmp_path, monkeypatch):
    """A measured table naming the sum tile for the shapes below (PDSERVE_SKINNY_CONFIG)."""
    def use(entries: dict) -> None:
        path = tmp_path / "skinny.json"
        path.write_text(json.dumps({f"{n},{k},m1": dict(block_n=bn, block_k=bk, num_warps=4, num_stages=2,
                                                         kind="sum") for (n, k), (bn, bk) in entries.items()}))
        monkeypatch.setenv("PDSERVE_SKINNY_CONFIG", str(path))
    return use


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n,k,block_n,block_k,offset", [(40, 200, 8, 64, 0.0), (33, 128, 8, 128, 0.0),
                                                        (48, 96, 16, 32, 1.0)])
def test_producer_writes_the_residual_stream_and_the_norms_parts(device, dtype, n, k, block_n, block_k, offset,
                                                                 tiles):
    tiles({(n, k): (block_n, block_k)})
    g = gen(n * 7 + k)
    x = randn((1, k), g, device, dtype, k ** -0.5)
    w = randn((n, k), g, device, dtype)
    res = randn((1, n), g, device, dtype, 2.0)
    nw = randn((n,), g, device, dtype)
    with force_fused():
        y = skinny_linear(x, w)  # the same kernel's product, rounded to the model's dtype
        row = nf.produce(x, w, res, nw, 1e-6, offset)
        normed, h_ref = fused_add_rms_norm_triton(y, res, nw, 1e-6, offset)
    assert torch.equal(row.h, h_ref)  # the residual stream bit for bit as the add+RMSNorm kernel writes it
    assert torch.equal(row.hw, (h_ref.float() * (nw.float() + offset)).to(dtype))
    assert row.partials.shape == (-(-n // block_n),) and row.partials.dtype == torch.float32
    torch.testing.assert_close(row.partials.sum(), h_ref.float().pow(2).sum(), rtol=1e-5, atol=1e-5)
    with force_fused():
        assert torch.equal(row.materialize(), rms_norm_triton(h_ref, nw, 1e-6, offset))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hidden,n,block_n,block_k,offset,bias", [(40, 72, 8, 64, 0.0, False),
                                                                  (33, 50, 8, 32, 0.0, True),
                                                                  (48, 64, 16, 16, 1.0, False)])
def test_consumer_is_the_norm_then_the_product(device, dtype, hidden, n, block_n, block_k, offset, bias, tiles):
    tiles({(hidden, 24): (8, 16), (n, hidden): (block_n, block_k)})
    g = gen(hidden * 3 + n)
    x = randn((1, 24), g, device, dtype, 24 ** -0.5)
    w0 = randn((hidden, 24), g, device, dtype)
    res = randn((1, hidden), g, device, dtype, 3.0)
    nw = randn((hidden,), g, device, dtype)
    w = randn((n, hidden), g, device, dtype, hidden ** -0.5)
    b = randn((n,), g, device, dtype) if bias else None
    with force_fused():
        row = nf.produce(x, w0, res, nw, 1e-5, offset)
        y = row.linear(w, b)
        ref = skinny_linear(rms_norm_triton(row.h, nw, 1e-5, offset), w, b)
    assert y.shape == (1, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])
    # the same sums in float64: rsqrt(mean(h^2) + eps) * (W @ (h * w)) + b
    h = row.h.double()
    expect = (w.double() @ row.hw.double().T).T * torch.rsqrt(h.pow(2).mean() + 1e-5)
    expect = expect + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), expect.to(dtype).double(), **TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
def test_gated_producer_takes_the_activation(device, dtype, tiles):
    """down_proj with act(gate) * up folded in, as a batch-1 step runs it, and the norm after it."""
    hidden, inter = 40, 96
    tiles({(hidden, inter): (8, 32)})
    g = gen(11)
    gu = randn((1, 2 * inter), g, device, dtype, 2.0)
    w = randn((hidden, inter), g, device, dtype, inter ** -0.5)
    res = randn((1, hidden), g, device, dtype)
    nw = randn((hidden,), g, device, dtype)
    with force_fused():
        row = nf.produce(gu, w, res, nw, 1e-6, 0.0, act="silu")
        y = skinny_act_linear(gu, "silu", w)
        _, h_ref = fused_add_rms_norm_triton(y, res, nw, 1e-6)
        apart = skinny_linear(act_and_mul_triton(gu, "silu"), w)
    assert torch.equal(row.h, h_ref)
    torch.testing.assert_close(y.float(), apart.float(), **TOL[dtype])


def test_folded_products_take_their_own_tiles(tmp_path, monkeypatch):
    """produce takes the "out" entry's tile ("act_out" with the activation) and the consumer the "in" entry's, where
    the table names them (their program counts), with the same results as the plain tiles give."""
    plain = dict(num_warps=4, num_stages=2, kind="sum")
    table = {"40,24,m1": dict(block_n=8, block_k=16, **plain), "40,24,m1,out": dict(block_n=4, block_k=8, **plain),
             "40,96,m1": dict(block_n=8, block_k=32, **plain), "40,96,m1,act_out": dict(block_n=16, block_k=32, **plain),
             "32,40,m1": dict(block_n=8, block_k=16, **plain), "32,40,m1,in": dict(block_n=16, block_k=64, **plain)}
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("PDSERVE_SKINNY_CONFIG", str(path))
    g = gen(9)
    x, w0 = randn((1, 24), g, "cpu", torch.float16, 0.2), randn((40, 24), g, "cpu", torch.float16)
    gu, wd = randn((1, 192), g, "cpu", torch.float16, 2.0), randn((40, 96), g, "cpu", torch.float16, 0.1)
    res, nw = randn((1, 40), g, "cpu", torch.float16, 3.0), randn((40,), g, "cpu", torch.float16)
    w = randn((32, 40), g, "cpu", torch.float16, 0.15)
    real = nf._skinny_sum_kernel
    spy = GridSpy(real)
    with force_fused():
        monkeypatch.setattr(nf, "_skinny_sum_kernel", spy)
        row = nf.produce(x, w0, res, nw, 1e-6)
        gated = nf.produce(gu, wd, res, nw, 1e-6, act="silu")
        y = row.linear(w)
        monkeypatch.setattr(nf, "_skinny_sum_kernel", real)
        ref_row = nf.produce(x, w0, res, nw, 1e-6, config=SkinnyConfig(8, 8, 4, 2, "sum"))  # same K steps
        ref_gated = nf.produce(gu, wd, res, nw, 1e-6, act="silu", config=SkinnyConfig(8, 32, 4, 2, "sum"))
        ref_y = ref_row.linear(w, config=SkinnyConfig(8, 16, 4, 2, "sum"))
    assert spy.grids == [(10,), (3,), (2,)]  # 40 / 4, 40 / 16 rounded up, 32 / 16
    assert row.partials.shape == (10,) and gated.partials.shape == (3,)
    assert torch.equal(row.h, ref_row.h) and torch.equal(gated.h, ref_gated.h)  # the residual stream, bit for bit
    torch.testing.assert_close(row.partials.sum(), ref_row.partials.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), ref_y.float(), **TOL[torch.float16])


@pytest.mark.parametrize("device,dtype", CASES)
def test_prefetched_folds_give_the_same_bits(device, dtype):
    """The producer (with and without the activation) and the consumer with the next weight tile loaded a step
    ahead (SkinnyConfig.prefetch): the same bits as without."""
    g = gen(13)
    x, w0 = randn((1, 96), g, device, dtype, 0.1), randn((40, 96), g, device, dtype, 0.1)
    gu = randn((1, 192), g, device, dtype, 2.0)
    res, nw = randn((1, 40), g, device, dtype, 3.0), randn((40,), g, device, dtype)
    w = randn((24, 40), g, device, dtype, 0.15)
    plain, ahead = SkinnyConfig(8, 32, 4, 2, "sum"), SkinnyConfig(8, 32, 4, 2, "sum", True)
    with force_fused():
        for act in (None, "silu"):
            inp = gu if act else x
            a, b = (nf.produce(inp, w0, res, nw, 1e-6, act=act, config=c) for c in (ahead, plain))
            assert torch.equal(a.h, b.h) and torch.equal(a.hw, b.hw) and torch.equal(a.partials, b.partials)
        assert torch.equal(a.linear(w, config=SkinnyConfig(8, 16, 4, 2, "sum", True)),
                           a.linear(w, config=SkinnyConfig(8, 16, 4, 2, "sum")))


def test_a_consumer_without_the_scale_would_be_caught(tiles):
    """The check above rejects the product of h * w left unscaled (1 / rms dropped)."""
    tiles({(40, 24): (8, 16), (32, 40): (8, 16)})
    g = gen(3)
    x, w0 = randn((1, 24), g, "cpu", torch.float16, 0.2), randn((40, 24), g, "cpu", torch.float16)
    res, nw = randn((1, 40), g, "cpu", torch.float16, 3.0), randn((40,), g, "cpu", torch.float16)
    w = randn((32, 40), g, "cpu", torch.float16, 0.15)
    with force_fused():
        row = nf.produce(x, w0, res, nw, 1e-6)
        unscaled = skinny_linear(row.hw, w)
        ref = skinny_linear(rms_norm_triton(row.h, nw, 1e-6), w)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(unscaled.float(), ref.float(), **TOL[torch.float16])


def test_what_the_fold_does_not_take(tiles, monkeypatch):
    """More rows, CPU tensors without the kernels, a cuBLAS tile, or the fold switched off: can_produce says no,
    and a consumer that cannot take it runs the norm's kernel first."""
    monkeypatch.delenv("PDSERVE_SKINNY_CONFIG", raising=False)
    w = torch.zeros(8, 32, dtype=torch.float16)
    one = torch.zeros(1, 32, dtype=torch.float16)
    assert not nf.can_produce(one, w)  # a CPU tensor: the references
    with force_fused():
        assert nf.can_produce(one, w)
        assert not nf.can_produce(torch.zeros(2, 32, dtype=torch.float16), w)
        assert nf.can_produce(torch.zeros(1, 64, dtype=torch.float16), w, gated=True)
        assert not nf.can_produce(torch.zeros(1, 48, dtype=torch.float16), w, gated=True)
        prev = nf.set_norm_fold(False)
        try:
            assert not nf.can_produce(one, w)
        finally:
            nf.set_norm_fold(prev)
        with pytest.raises(ValueError):
            nf.produce(one, w, torch.zeros(1, 7, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6)
    tiles({(8, 32): (8, 16)})
    g = gen(5)
    x, w0 = randn((1, 32), g, "cpu", torch.float16, 0.2), randn((8, 32), g, "cpu", torch.float16)
    res, nw = randn((1, 8), g, "cpu", torch.float16), randn((8,), g, "cpu", torch.float16)
    w2 = randn((16, 8), g, "cpu", torch.float16)
    with force_fused():
        row = nf.produce(x, w0, res, nw, 1e-6)
        prev = nf.set_norm_fold(False)
        try:
            y = row.linear(w2)  # the fold switched off: the norm's kernel, then the product
        finally:
            nf.set_norm_fold(prev)
        ref = skinny_linear(rms_norm_triton(row.h, nw, 1e-6), w2)
    assert torch.equal(y, ref)


@pytest.mark.gpu
@_needs_cuda
def test_qwen3_8b_shapes_in_a_cuda_graph():
    """o_proj -> gate_up and down_proj -> q/k/v of Qwen3-8B as a decode graph runs them (PDL on sm_90), replayed with
    new inputs, against the norm's kernel between the products."""
    g = gen(1)
    wo = randn((4096, 4096), g, "cuda", torch.bfloat16, 4096 ** -0.5)
    wgu = randn((24576, 4096), g, "cuda", torch.bfloat16, 4096 ** -0.5)
    wd = randn((4096, 12288), g, "cuda", torch.bfloat16, 12288 ** -0.5)
    wqkv = randn((6144, 4096), g, "cuda", torch.bfloat16, 4096 ** -0.5)
    nw1, nw2 = randn((4096,), g, "cuda", torch.bfloat16), randn((4096,), g, "cuda", torch.bfloat16)
    o = torch.zeros((1, 4096), dtype=torch.bfloat16, device="cuda")
    res = torch.zeros((1, 4096), dtype=torch.bfloat16, device="cuda")

    def step():
        a = nf.produce(o, wo, res, nw1, 1e-6)
        gu = a.linear(wgu)
        b = nf.produce(gu, wd, a.h, nw2, 1e-6, act="silu")
        return a, gu, b, b.linear(wqkv)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, gu, b, qkv = step()
    for seed in (2, 3):
        o.copy_(randn((1, 4096), gen(seed), "cuda", torch.bfloat16))
        res.copy_(randn((1, 4096), gen(seed + 10), "cuda", torch.bfloat16, 4.0))
        graph.replay()
        y = skinny_linear(o, wo)
        n1, h1 = fused_add_rms_norm_triton(y, res, nw1, 1e-6)
        assert torch.equal(a.h, h1)
        torch.testing.assert_close(gu.float(), skinny_linear(n1, wgu).float(), **TOL[torch.bfloat16])
        n2, h2 = fused_add_rms_norm_triton(skinny_act_linear(gu, "silu", wd), h1, nw2, 1e-6)
        torch.testing.assert_close(b.h.float(), h2.float(), **TOL[torch.bfloat16])
        torch.testing.assert_close(qkv.float(), skinny_linear(rms_norm_triton(b.h, nw2, 1e-6), wqkv).float(),
                                   **TOL[torch.bfloat16])

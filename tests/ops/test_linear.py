"""The skinny linear kernel (pdserve.ops.linear) against x @ W^T in float32 rounded once: both inner products (dot
for up to 16 rows, sum for one), shapes that are and are not multiples of the tile, bias, a strided x; the routing
of `linear` and the measured-table lookup."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.ops.kernel_cases import TOL, GridSpy, gen, randn

pytest.importorskip("triton")

from pdserve.ops import linear as lin  # noqa: E402
from pdserve.ops.dispatch import force_fused  # noqa: E402
from pdserve.ops.linear import SkinnyConfig, linear, set_skinny, skinny_config, skinny_linear  # noqa: E402

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [pytest.param("cpu", torch.float16, id="cpu-float16")] + [
    pytest.param("cuda", dt, id=f"cuda-{str(dt)[6:]}", marks=[pytest.mark.gpu, _needs_cuda])
    for dt in (torch.bfloat16, torch.float16)]


def _ref(x, w, b):
    y = x.float() @ w.float().T
    return (y + b.float() if b is not None else y).to(x.dtype)


def _check(y, ref):
    torch.testing.assert_close(y.float(), ref.float(), **TOL[ref.dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("kind", ["dot", "sum", "sum+prefetch"])
@pytest.mark.parametrize("m,n,k,block_n,block_k", [(1, 40, 200, 16, 64), (3, 64, 256, 16, 128), (16, 48, 96, 32, 32),
                                                   (1, 33, 128, 8, 64), (7, 32, 512, 16, 256), (1, 32, 256, 8, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_matches_reference(device, dtype, kind, m, n, k, block_n, block_k, bias):
    if kind == "dot" and block_n < 16:
        pytest.skip("the dot tile needs 16 columns")
    g = gen(m * 1000 + n * 10 + k)
    x = randn((m, k), g, device, dtype, k ** -0.5)
    w = randn((n, k), g, device, dtype)
    b = randn((n,), g, device, dtype) if bias else None
    with force_fused():
        y = skinny_linear(x, w, b, SkinnyConfig(block_n, block_k, 4, 2, kind.split("+")[0],
                                                prefetch=kind.endswith("prefetch")))
    assert y.shape == (m, n) and y.dtype == dtype
    _check(y, _ref(x, w, b))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n,k,block_n,block_k", [(40, 200, 16, 64), (33, 128, 8, 64), (32, 256, 8, 64),
                                                 (24, 64, 8, 64)])
def test_prefetched_tiles_give_the_same_bits(device, dtype, n, k, block_n, block_k):
    """The sum kernel with the next weight tile loaded a step ahead sums the same tiles in the same order: the same
    bits as without, with the activation folded in too; K not a multiple of the tile, N not a multiple of the
    columns, and a single tile (nothing to prefetch) included."""
    g = gen(n * 31 + k)
    x = randn((1, k), g, device, dtype, k ** -0.5)
    gu = randn((1, 2 * k), g, device, dtype, 2.0)
    w = randn((n, k), g, device, dtype)
    plain, ahead = SkinnyConfig(block_n, block_k, 4, 2, "sum"), SkinnyConfig(block_n, block_k, 4, 2, "sum", True)
    with force_fused():
        assert torch.equal(skinny_linear(x, w, None, ahead), skinny_linear(x, w, None, plain))
        assert torch.equal(lin.skinny_act_linear(gu, "silu", w, None, ahead),
                           lin.skinny_act_linear(gu, "silu", w, None, plain))


@pytest.mark.parametrize("device,dtype", CASES)
def test_strided_rows_and_out(device, dtype):
    """x is a column slice of a wider tensor (row stride > K), as a split of a fused projection is."""
    g = gen(5)
    big = randn((4, 96), g, device, dtype, 0.1)
    x = big[:, :64]
    w = randn((48, 64), g, device, dtype)
    out = torch.full((4, 48), 7.0, dtype=dtype, device=device)
    with force_fused():
        y = skinny_linear(x, w, None, SkinnyConfig(16, 32, 4, 2, "dot"), out=out)
    assert y.data_ptr() == out.data_ptr()
    _check(y, _ref(x, w, None))


def test_wrong_operand_is_refused():
    w = torch.zeros(8, 32, dtype=torch.float16)
    with pytest.raises(ValueError):
        skinny_linear(torch.zeros(17, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError):
        skinny_linear(torch.zeros(2, 16, dtype=torch.float16), w)


def test_a_wrong_kernel_would_be_caught():
    """The checker is not blind: the transposed weight gives another answer."""
    g = gen(11)
    x = randn((2, 32), g, "cpu", torch.float16, 0.2)
    w = randn((32, 32), g, "cpu", torch.float16)
    with force_fused():
        y = skinny_linear(x, w.T.contiguous(), None, SkinnyConfig(16, 32, 4, 2, "dot"))
    with pytest.raises(AssertionError):
        _check(y, _ref(x, w, None))


def test_linear_routes_few_rows_of_16_bit_tensors(monkeypatch, tmp_path):
    calls = []
    real = lin.skinny_linear
    monkeypatch.setattr(lin, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.delenv("PDSERVE_SKINNY_CONFIG", raising=False)
    g = gen(3)
    w = randn((32, 64), g, "cpu", torch.float16)
    one, two = randn((1, 64), g, "cpu", torch.float16, 0.1), randn((2, 64), g, "cpu", torch.float16, 0.1)
    big = randn((17, 64), g, "cpu", torch.float16, 0.1)
    linear(one, w)  # CPU tensors: F.linear unless forced
    assert calls == []
    with force_fused():
        _check(linear(one, w), _ref(one, w, None))
        linear(two, w)  # no table entry: more than one row stays with cuBLAS
        linear(big, w)
        linear(one.float(), w.float())  # fp32: cuBLAS/TF32 semantics stay with F.linear
        prev = set_skinny(False)
        try:
            linear(one, w)
        finally:
            set_skinny(prev)
        assert calls == [(1, 64)]
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"32,64": {"block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2,
                                              "kind": "dot"}}))
        monkeypatch.setenv("PDSERVE_SKINNY_CONFIG", str(path))
        _check(linear(two, w), _ref(two, w, None))  # a measured entry sends two rows to the dot kernel
    assert calls == [(1, 64), (2, 64)]
    torch.testing.assert_close(linear(big, w), F.linear(big, w))


def test_measured_table_lookup(tmp_path, monkeypatch):
    table = {"_source": "a test", "default": {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 3, "kind": "dot"},
             "4096,4096": {"block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 4, "kind": "dot"},
             "4096,4096,m1": {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 5, "kind": "sum"},
             "6144,4096": {"block_n": 8, "block_k": 256, "num_warps": 4, "num_stages": 4, "kind": "sum"}}
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps(table))
    monkeypatch.delenv("PDSERVE_SKINNY_CONFIG", raising=False)
    assert skinny_config(4096, 4096, 1) == lin.ONE_ROW_CONFIG
    assert skinny_config(4096, 4096, 2).kind == "cublas"
    monkeypatch.setenv("PDSERVE_SKINNY_CONFIG", str(path))
    assert skinny_config(4096, 4096, 1) == SkinnyConfig(8, 512, 4, 5, "sum")
    assert skinny_config(4096, 4096, 8) == SkinnyConfig(16, 512, 8, 4, "dot")
    assert skinny_config(6144, 4096, 1) == SkinnyConfig(8, 256, 4, 4, "sum")
    assert skinny_config(6144, 4096, 2) == SkinnyConfig(16, 256, 4, 4, "dot")  # sum serves one row only
    assert skinny_config(1024, 1024, 3) == SkinnyConfig(32, 128, 4, 3, "dot")


def test_shipped_tables_parse():
    """Every table shipped under configs/skinny_linear names real tiles (the dot tile needs 16+ columns; a fold's
    entry, "N,K,m1,<fold>", is a sum tile of a fold the kernel has)."""
    files = sorted(lin.CONFIG_DIR.glob("device=*.json"))
    assert files
    for f in files:
        table = lin._load_table(str(f))
        assert table
        for key, cfg in table.items():
            assert cfg.kind in ("dot", "sum", "cublas"), (f, key)
            assert cfg.kind != "dot" or cfg.block_n >= 16, (f, key)
            parts = key.split(",")
            if len(parts) == 4:
                assert parts[2] == "m1" and parts[3] in lin.FOLDS and cfg.kind == "sum", (f, key)
            else:
                assert cfg.kind != "sum" or key.endswith(",m1") or key == "default", (f, key)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)])
def test_qwen3_8b_shapes_on_cuda(m, n, k):
    g = gen(n + k + m)
    x = randn((m, k), g, "cuda", torch.bfloat16, k ** -0.5)
    w = randn((n, k), g, "cuda", torch.bfloat16)
    y = linear(x, w)
    _check(y, _ref(x, w, None))


@pytest.mark.gpu
@_needs_cuda
def test_captured_in_a_cuda_graph():
    g = gen(1)
    w = randn((4096, 4096), g, "cuda", torch.bfloat16)
    x = torch.zeros((1, 4096), dtype=torch.bfloat16, device="cuda")
    out = torch.empty((1, 4096), dtype=torch.bfloat16, device="cuda")
    skinny_linear(x, w, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, out=out)
    for seed in (2, 3):
        x.copy_(randn((1, 4096), gen(seed), "cuda", torch.bfloat16, 4096 ** -0.5))
        graph.replay()
        _check(out, _ref(x, w, None))


# ---- the activation folded into a one-row down projection (act_linear)

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("n,k,block_n,block_k,bias", [(40, 200, 8, 64, False), (48, 128, 16, 128, True),
                                                      (33, 96, 8, 32, False)])
def test_activation_folded_into_one_row_product(device, dtype, act, n, k, block_n, block_k, bias):
    from pdserve.ops.activation import act_and_mul_triton
    g = gen(n + k)
    gu = randn((1, 2 * k), g, device, dtype, 2.0)
    w = randn((n, k), g, device, dtype, k ** -0.5)
    b = randn((n,), g, device, dtype) if bias else None
    with force_fused():
        y = lin.skinny_act_linear(gu, act, w, b, SkinnyConfig(block_n, block_k, 4, 2, "sum"))
        a = act_and_mul_triton(gu, act)  # the activation's own kernel: the input the product would have read
    assert y.shape == (1, n) and y.dtype == dtype
    _check(y, _ref(a, w, b))


def test_folded_activation_refuses_what_it_cannot_take():
    w = torch.zeros(8, 32, dtype=torch.float16)
    with pytest.raises(ValueError):
        lin.skinny_act_linear(torch.zeros(1, 32, dtype=torch.float16), "silu", w)  # not [1, 2K]
    with pytest.raises(ValueError):
        lin.skinny_act_linear(torch.zeros(2, 64, dtype=torch.float16), "silu", w)
    with pytest.raises(ValueError):
        lin.skinny_act_linear(torch.zeros(1, 64, dtype=torch.float16), "relu", w)


def test_a_wrong_fold_would_be_caught():
    """The up half left out (act(gate) alone) gives another answer than the check expects."""
    g = gen(21)
    gu = randn((1, 128), g, "cpu", torch.float16, 2.0)
    w = randn((32, 64), g, "cpu", torch.float16, 0.125)
    with force_fused():
        y = lin.skinny_act_linear(gu, "silu", w)
    with pytest.raises(AssertionError):
        _check(y, _ref(torch.nn.functional.silu(gu[:, :64].float()).half(), w, None))


def test_activation_folds_only_into_one_row_products(monkeypatch):
    """act_linear takes the folded kernel for one row of a 16-bit tensor the fused ops handle, and the
    activation's kernel then `linear` for more rows, CPU tensors, or with folding switched off; same result."""
    calls = []
    real = lin.skinny_act_linear
    monkeypatch.setattr(lin, "skinny_act_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.delenv("PDSERVE_SKINNY_CONFIG", raising=False)
    g = gen(4)
    w = randn((32, 64), g, "cpu", torch.float16, 0.125)
    gu = randn((1, 128), g, "cpu", torch.float16)
    lin.act_linear(gu, "silu", w)  # a CPU tensor: the references
    assert calls == []
    with force_fused():
        folded = lin.act_linear(gu, "silu", w)
        assert calls == [(1, 128)]
        two = lin.act_linear(torch.cat([gu, gu]), "silu", w)
        prev = lin.set_fold(False)
        try:
            apart = lin.act_linear(gu, "silu", w)
        finally:
            lin.set_fold(prev)
    assert calls == [(1, 128)]
    _check(folded, apart)
    _check(two[1:], apart)


@pytest.mark.gpu
@_needs_cuda
def test_activation_fold_on_qwen3_8b_down_projection_in_a_cuda_graph():
    """As a decode graph runs it (PDL on sm_90): replayed with new inputs, against the activation's own kernel
    followed by the product."""
    from pdserve.ops.activation import act_and_mul_triton
    w = randn((4096, 12288), gen(9), "cuda", torch.bfloat16, 12288 ** -0.5)
    gu = torch.zeros((1, 24576), dtype=torch.bfloat16, device="cuda")
    lin.act_linear(gu, "silu", w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lin.act_linear(gu, "silu", w)
    for seed in (2, 3):
        gu.copy_(randn((1, 24576), gen(seed), "cuda", torch.bfloat16, 2.0))
        graph.replay()
        _check(y, _ref(act_and_mul_triton(gu, "silu"), w, None))


def test_folded_tiles_have_their_own_entries(tmp_path, monkeypatch):
    """fold_config: a table's "N,K,m1,<fold>" entry for the sum kernel with that fold, else the plain one-row tile;
    a fold entry that is not a sum tile is passed over; an unknown fold is refused."""
    plain = {"block_n": 4, "block_k": 1024, "num_warps": 8, "num_stages": 3, "kind": "sum"}
    table = {"4096,12288,m1": plain,
             "4096,12288,m1,act_out": {"block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 2, "kind": "sum"},
             "4096,12288,m1,act": {"block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 2, "kind": "dot"},
             "6144,4096,m1,in": {"block_n": 8, "block_k": 256, "num_warps": 4, "num_stages": 3, "kind": "sum"}}
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("PDSERVE_SKINNY_CONFIG", str(path))
    assert lin.fold_config(4096, 12288, "act_out") == SkinnyConfig(16, 512, 8, 2, "sum")
    assert lin.fold_config(4096, 12288, "act") == SkinnyConfig(**plain)  # a dot tile cannot serve the fold
    assert lin.fold_config(4096, 12288, "out") == SkinnyConfig(**plain)
    assert lin.fold_config(6144, 4096, "in") == SkinnyConfig(8, 256, 4, 3, "sum")
    assert skinny_config(6144, 4096, 1) == lin.ONE_ROW_CONFIG  # the fold entry is not the plain product's
    assert skinny_config(4096, 12288, 1) == SkinnyConfig(**plain)
    with pytest.raises(ValueError):
        lin.fold_config(4096, 12288, "norm")


def test_folded_activation_takes_its_own_tile(tmp_path, monkeypatch):
    """skinny_act_linear launches the "act" entry's tile (its program count) and still computes the same product."""
    from pdserve.ops.activation import act_and_mul_triton
    table = {"32,64,m1": {"block_n": 4, "block_k": 32, "num_warps": 4, "num_stages": 2, "kind": "sum"},
             "32,64,m1,act": {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2, "kind": "sum"}}
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("PDSERVE_SKINNY_CONFIG", str(path))
    spy = GridSpy(lin._skinny_sum_kernel)
    monkeypatch.setattr(lin, "_skinny_sum_kernel", spy)
    g = gen(8)
    gu = randn((1, 128), g, "cpu", torch.float16, 2.0)
    w = randn((32, 64), g, "cpu", torch.float16, 0.125)
    with force_fused():
        y = lin.skinny_act_linear(gu, "silu", w)
        a = act_and_mul_triton(gu, "silu")
    assert spy.grids == [(2,)]  # 32 columns / 16 a program: the act entry, not the plain one's 8 programs
    _check(y, _ref(a, w, None))

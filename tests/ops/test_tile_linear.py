"""The tile linear kernel (pdserve.ops.tile_linear) against x @ W^T in float32 rounded once: row counts that are and
are not multiples of the tile (the last tile re-reads rows from the top and must not store them), N and K off the
tile, bias, a strided x; the routing of pdserve.ops.linear.linear by row count and the measured-table lookup."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.ops.kernel_cases import TOL, gen, randn

pytest.importorskip("triton")

from pdserve.ops import linear as lin  # noqa: E402
from pdserve.ops import tile_linear as tl_mod  # noqa: E402
from pdserve.ops.dispatch import force_fused  # noqa: E402
from pdserve.ops.tile_linear import CUBLAS, TileConfig, set_tile_linear, tile_config, tile_linear  # noqa: E402

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
@pytest.mark.parametrize("m,n,k,cfg", [
    (32, 32, 64, TileConfig(16, 16, 32, 4, 2)),   # every dimension a multiple of the tile
    (21, 48, 96, TileConfig(16, 32, 32, 4, 2)),   # M and N off the tile: the last tiles re-read rows/columns
    (5, 40, 80, TileConfig(16, 16, 32, 4, 2)),    # fewer rows than one tile; K off BLOCK_K (masked K)
    (50, 24, 64, TileConfig(32, 16, 64, 4, 2)),
])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_matches_reference(device, dtype, m, n, k, cfg, bias):
    g = gen(m * 1000 + n * 10 + k)
    x = randn((m, k), g, device, dtype, k ** -0.5)
    w = randn((n, k), g, device, dtype)
    b = randn((n,), g, device, dtype) if bias else None
    out = torch.full((m + 3, n), 7.0, dtype=dtype, device=device)  # rows past M must stay untouched
    with force_fused():
        y = tile_linear(x, w, b, cfg, out=out[:m])
    assert y.shape == (m, n) and y.dtype == dtype
    _check(y, _ref(x, w, b))
    assert torch.all(out[m:] == 7.0)


@pytest.mark.parametrize("device,dtype", CASES)
def test_strided_rows(device, dtype):
    """x is a column slice of a wider tensor (row stride > K), as a split of a fused projection is."""
    g = gen(5)
    big = randn((20, 96), g, device, dtype, 0.1)
    x = big[:, :64]
    w = randn((48, 64), g, device, dtype)
    with force_fused():
        y = tile_linear(x, w, None, TileConfig(16, 16, 32, 4, 2))
    _check(y, _ref(x, w, None))


def test_a_wrong_kernel_would_be_caught():
    """The checker is not blind: the transposed weight gives another answer."""
    g = gen(11)
    x = randn((20, 32), g, "cpu", torch.float16, 0.2)
    w = randn((32, 32), g, "cpu", torch.float16)
    with force_fused():
        y = tile_linear(x, w.T.contiguous(), None, TileConfig(16, 16, 32, 4, 2))
    with pytest.raises(AssertionError):
        _check(y, _ref(x, w, None))


def test_wrong_operand_is_refused():
    with pytest.raises(ValueError):
        tile_linear(torch.zeros(20, 16, dtype=torch.float16), torch.zeros(8, 32, dtype=torch.float16))


def _table(tmp_path, entries: dict) -> str:
    path = tmp_path / "tile.json"
    path.write_text(json.dumps({"_source": "a test", **entries}))
    return str(path)


def test_measured_table_lookup(tmp_path, monkeypatch):
    t = TileConfig(128, 64, 64, 4, 4)
    u = TileConfig(64, 128, 128, 4, 3)
    path = _table(tmp_path, {"4096,4096,64": {**CUBLAS.__dict__}, "4096,4096,256": t.__dict__,
                             "4096,4096,512": u.__dict__})
    monkeypatch.delenv("PDSERVE_TILE_LINEAR_CONFIG", raising=False)
    assert tile_config(4096, 4096, 256) == CUBLAS  # no table for a CPU device
    monkeypatch.setenv("PDSERVE_TILE_LINEAR_CONFIG", path)
    assert tile_config(4096, 4096, 16) == CUBLAS  # below MIN_ROWS: the skinny kernel's range
    assert tile_config(4096, 4096, 64) == CUBLAS
    assert tile_config(4096, 4096, 65) == t  # the smallest measured row count >= M
    assert tile_config(4096, 4096, 256) == t
    assert tile_config(4096, 4096, 300) == u
    assert tile_config(4096, 4096, 513) == CUBLAS  # past the largest measured row count
    assert tile_config(6144, 4096, 256) == CUBLAS  # a shape the table does not name
    assert tile_config(4096, 4096, tl_mod.MAX_ROWS + 1) == CUBLAS


def test_linear_routes_by_rows(monkeypatch, tmp_path):
    calls = []
    real_tile, real_skinny = lin.tile_linear, lin.skinny_linear
    monkeypatch.setattr(lin, "tile_linear", lambda *a, **kw: calls.append(("tile", a[0].shape[0])) or real_tile(*a, **kw))
    monkeypatch.setattr(lin, "skinny_linear",
                        lambda *a, **kw: calls.append(("skinny", a[0].shape[0])) or real_skinny(*a, **kw))
    monkeypatch.setenv("PDSERVE_TILE_LINEAR_CONFIG", _table(tmp_path, {"32,64,40": TileConfig(16, 16, 32, 4, 2).__dict__}))
    monkeypatch.delenv("PDSERVE_SKINNY_CONFIG", raising=False)
    g = gen(3)
    w = randn((32, 64), g, "cpu", torch.float16)
    xs = {m: randn((m, 64), g, "cpu", torch.float16, 0.1) for m in (1, 20, 41)}
    linear = lin.linear
    torch.testing.assert_close(linear(xs[20], w), F.linear(xs[20], w))  # CPU tensors: F.linear unless forced
    assert calls == []
    with force_fused():
        for m in (1, 20, 41):
            _check(linear(xs[m], w), _ref(xs[m], w, None))
        assert calls == [("skinny", 1), ("tile", 20)]  # 41 rows: past the table's 40, cuBLAS
        _check(linear(xs[20].float(), w.float()), _ref(xs[20].float(), w.float(), None))  # fp32 stays with F.linear
        prev = set_tile_linear(False)
        try:
            linear(xs[20], w)
        finally:
            set_tile_linear(prev)
    assert calls == [("skinny", 1), ("tile", 20)]


def test_shipped_tables_parse():
    """Every table shipped under configs/tile_linear names real tiles at row counts inside the kernel's range."""
    files = sorted(tl_mod.CONFIG_DIR.glob("device=*.json"))
    for f in files:
        table = tl_mod._load_table(str(f))
        assert table
        for (n, k), entries in table.items():
            for rows, cfg in entries:
                assert tl_mod.MIN_ROWS <= rows <= tl_mod.MAX_ROWS, (f, n, k, rows)
                assert cfg.kind in ("tile", "cublas"), (f, n, k, rows)
                assert cfg.kind == "cublas" or min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16, (f, n, k, rows)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("m", [17, 100, 256, 333])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 2048), (2048, 4096)])
def test_model_shapes_on_cuda(m, n, k):
    g = gen(n + k + m)
    x = randn((m, k), g, "cuda", torch.bfloat16, k ** -0.5)
    w = randn((n, k), g, "cuda", torch.bfloat16)
    for cfg in (TileConfig(), TileConfig(64, 128, 64, 4, 3), TileConfig(256, 32, 64, 8, 3)):
        _check(tile_linear(x, w, None, cfg), _ref(x, w, None))


@pytest.mark.gpu
@_needs_cuda
def test_captured_in_a_cuda_graph():
    g = gen(1)
    w = randn((4096, 4096), g, "cuda", torch.bfloat16)
    x = torch.zeros((256, 4096), dtype=torch.bfloat16, device="cuda")
    out = torch.empty((256, 4096), dtype=torch.bfloat16, device="cuda")
    tile_linear(x, w, out=out, config=TileConfig())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tile_linear(x, w, out=out, config=TileConfig())
    for seed in (2, 3):
        x.copy_(randn((256, 4096), gen(seed), "cuda", torch.bfloat16, 4096 ** -0.5))
        graph.replay()
        _check(out, _ref(x, w, None))

"""Long prefill rows through a library kernel (pdserve.ops.attention.library_prefill): the merge of two partial
attentions by their log-sum-exps (Triton kernel and torch reference) against attention over all keys; which rows
qualify; the prefix gather from the real pool layout; the whole path (gather, two calls, merge, output rows) against
the torch reference backend, with cuDNN's call replaced on CPU by a torch one of the same contract; on CUDA, the
Triton backend's forward taking that path with cuDNN itself, and a whole engine over an fp8 pool taking it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve import envs
from pdserve.model.forward_context import layer_view
from pdserve.ops.attention import library_prefill as lib
from pdserve.ops.attention.merge import merge_two, merge_two_reference
from pdserve.ops.attention.torch_ref import TorchAttentionBackend, dequantize, gather_seq
from pdserve.ops.dispatch import force_fused
from tests.ops.attention_helpers import assert_close, make_problem, poisoned


def _attention_with_lse(q, k, v, scale, causal):
    """q [H, L, D], k/v [H, S, D] -> (out [H, L, D] fp32, lse [H, L] natural log); causal: top-left aligned."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v.float()), torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_merge_two_equals_attention_over_all_keys(dtype, fused):
    g = torch.Generator().manual_seed(0)
    h, n, d, s1, s2 = 3, 37, 80, 19, 45
    q = torch.randn((h, n, d), generator=g)
    k = torch.randn((h, s1 + s2, d), generator=g)
    v = torch.randn((h, s1 + s2, d), generator=g)
    full, _ = _attention_with_lse(q, k, v, 0.2, False)
    o1, l1 = _attention_with_lse(q, k[:, :s1], v[:, :s1], 0.2, False)
    o2, l2 = _attention_with_lse(q, k[:, s1:], v[:, s1:], 0.2, False)
    out = poisoned(torch.empty((n, h, d), dtype=dtype))
    with force_fused(fused):
        merge_two(o1.to(dtype), l1, o2.to(dtype), l2, out)
    assert not out.isnan().any()
    assert_close(out.float(), full.transpose(0, 1), dtype, "merge_two")
    assert_close(merge_two_reference(o1, l1, o2, l2), full.transpose(0, 1), torch.float32, "reference")


@pytest.mark.parametrize("fused", [False, True])
def test_merge_two_side_without_keys_weighs_nothing(fused):
    g = torch.Generator().manual_seed(1)
    h, n, d = 2, 5, 16
    o1, o2 = torch.randn((h, n, d), generator=g), torch.randn((h, n, d), generator=g)
    l1, l2 = torch.randn((h, n), generator=g), torch.full((h, n), float("-inf"))
    l1[1] = float("-inf")  # head 1: both sides empty -> 0
    out = torch.empty((n, h, d))
    with force_fused(fused):
        merge_two(o1, l1, o2, l2, out)
    torch.testing.assert_close(out[:, 0], o1[0], atol=1e-6, rtol=1e-6)
    assert (out[:, 1] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_merge_two_is_one_binary_for_any_length_and_offset():
    """A chunk's length (a multiple of 16 or not) and its rows' offset in the causal call's log-sum-exps (4-byte
    floats: 16-byte aligned or not) differ from step to step: none of them may compile the kernel again."""
    from triton import knobs

    dev = torch.device("cuda")
    h, d, total = 4, 128, 1024
    o = torch.randn((h, total, d), device=dev, dtype=torch.bfloat16)
    lse = torch.randn((h, total), device=dev)

    def run(n, r):
        out = torch.empty((n, h, d), device=dev, dtype=torch.bfloat16)
        merge_two(o[:, :n], lse[:, :n], o[:, r: r + n], lse[:, r: r + n], out)
        torch.testing.assert_close(out, merge_two_reference(o[:, :n], lse[:, :n], o[:, r: r + n], lse[:, r: r + n]),
                                   atol=2e-2, rtol=2e-2)

    run(512, 0)  # compiles (or loads) the one binary
    rt = knobs.runtime
    saved, misses = rt.jit_cache_hook, []

    def count(**kw):
        misses.append(kw.get("repr"))
        return saved(**kw) if saved is not None else None

    rt.jit_cache_hook = count
    try:
        for n, r in ((500, 0), (512, 2), (500, 3), (1, 1), (496, 496)):
            run(n, r)
    finally:
        rt.jit_cache_hook = saved
    assert misses == [], f"merge_two compiled again for {misses}"


def test_merge_two_refuses_mismatched_shapes():
    o = torch.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="merge_two"):
        merge_two(o, torch.zeros((2, 4)), o, torch.zeros((2, 5)), torch.zeros((4, 2, 8)))


def test_rows_qualify_by_length_and_prefix():
    assert lib.row_qualifies(lib.MIN_FRESH, 0) and not lib.row_qualifies(lib.MIN_FRESH - 1, 0)
    assert lib.row_qualifies(lib.MIN_CHUNK, 1) and not lib.row_qualifies(lib.MIN_CHUNK - 1, 5000)
    # decode rows (one new token) never count; one short prefill row sends the whole step to the Triton kernel
    qsl, lens = [0, 1, 1 + lib.MIN_FRESH, 2 + lib.MIN_FRESH], [50, lib.MIN_FRESH, 9]
    assert lib._qualifying_rows(qsl, lens) == [(1, 1, lib.MIN_FRESH, 0)]
    qsl2, lens2 = [0, lib.MIN_FRESH, lib.MIN_FRESH + 2], [lib.MIN_FRESH, 2]
    assert lib._qualifying_rows(qsl2, lens2) is None
    assert lib._qualifying_rows([0, 1, 2], [7, 9]) is None  # decode only


def test_short_chunks_qualify_on_shapes_planned_before(monkeypatch):
    """Below MIN_CHUNK a chunk on a prefix takes cuDNN only where its calls' shapes were run before (no plan to
    build while serving), and only from MIN_PLANNED tokens; a fresh short prompt never."""
    monkeypatch.setattr(lib, "_planned_shapes", set())
    assert not lib.row_qualifies(2048, 4096)
    lib._planned_shapes.add(lib.bucketed_shapes(2048, 4096)[:3])  # as attend_row records a row it ran (the warm-up's)
    assert lib.row_qualifies(2048, 4096)
    assert lib.row_qualifies(1800, 4096)  # padded to the same 2048 query rows and causal size
    assert not lib.row_qualifies(2048, 4096 + 200)  # 200 prefix tokens join the causal call: a larger size
    assert not lib.row_qualifies(2048, 5120) and not lib.row_qualifies(2304, 4096)  # other prefix, other rows
    lib._planned_shapes.add(lib.bucketed_shapes(1024, 0)[:3])
    assert not lib.row_qualifies(1024, 0)  # a fresh prompt: MIN_FRESH decides, planned or not
    lib._planned_shapes.add(lib.bucketed_shapes(256, 4096)[:3])
    assert lib.MIN_PLANNED > 256 and not lib.row_qualifies(256, 4096)  # too short whatever was planned


def test_off_on_cpu_and_by_environment(monkeypatch):
    assert not lib.enabled(torch.device("cpu"))
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY", "none")
    assert envs.prefill_library() == "none" and not lib.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY", "cudnn-please")
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_LIBRARY"):
        envs.prefill_library()
    p = make_problem([lib.MIN_FRESH], [lib.MIN_FRESH], hq=2, hk=1, d=8, bs=16, write_new=True)
    monkeypatch.delenv("PDSERVE_PREFILL_LIBRARY")
    assert lib.library_rows(p.meta, p.q, p.kv_layer, p.k, None, None) is None  # CPU: the Triton path


def test_min_chunk_from_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_PREFILL_LIBRARY_MIN_CHUNK", raising=False)
    assert envs.prefill_library_min_chunk(4096) == 4096 == lib.MIN_CHUNK  # the default, as imported here
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY_MIN_CHUNK", "2048")
    assert envs.prefill_library_min_chunk(4096) == 2048
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY_MIN_CHUNK", "0")
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_LIBRARY_MIN_CHUNK"):
        envs.prefill_library_min_chunk(4096)


def test_fp8_pools_from_the_environment(monkeypatch):
    """PDSERVE_PREFILL_LIBRARY_FP8 (read at import, so a server's engine processes take it): 1 / 0 / unset."""
    monkeypatch.delenv("PDSERVE_PREFILL_LIBRARY_FP8", raising=False)
    assert envs.prefill_library_fp8(False) is False and envs.prefill_library_fp8(True) is True
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY_FP8", "1")
    assert envs.prefill_library_fp8(False) is True
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY_FP8", "0")
    assert envs.prefill_library_fp8(True) is False
    monkeypatch.setenv("PDSERVE_PREFILL_LIBRARY_FP8", "yes")
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_LIBRARY_FP8"):
        envs.prefill_library_fp8(False)
    code = "from pdserve.ops.attention import library_prefill as lib; print(lib.FP8_POOLS)"
    for value, want in (("1", "True"), ("0", "False")):
        env = {**os.environ, "PDSERVE_PREFILL_LIBRARY_FP8": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, out.stderr[-2000:]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("hk", [2, 3])
def test_gather_prefix_reads_the_real_pool_layout(fused, hk):
    """torch's index_select and the Triton kernel (a program per block and K or V; 3 heads: a masked head lane)."""
    g = torch.Generator().manual_seed(2)
    nb, layers, bs, d = 9, 3, 4, 8
    pool = torch.randn((nb, hk, layers, 2, bs, d), generator=g)  # runner.kv_cache_shape's layout
    layer = layer_view(pool, 1)
    table = torch.tensor([5, 2, 7, 0, 3], dtype=torch.int32)
    for ctx in (13, 16, 1):
        with force_fused(fused):
            k, v = lib.gather_prefix(layer, table, ctx)
        rk, rv = gather_seq(layer.contiguous(), table, ctx)
        assert k.shape == (ctx, hk, d) and k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", ["both", "none", "k only"])
def test_gather_prefix_dequantizes_an_fp8_pool(fused, kv_dtype, scales):
    """An fp8 pool's prefix comes out in the model's dtype, times its scales in fp32: bit for bit what the reference
    dequantizes (torch's path; the Triton kernel's on CUDA, where the rounding to 16 bits is to nearest even, as
    torch's). Triton's interpreter rounds fp32 to bfloat16 toward zero whatever the kernel asks, so there the
    kernel's values are held to one unit in the last place."""
    g = torch.Generator().manual_seed(4)
    nb, layers, bs, hk, d = 9, 2, 4, 3, 8
    pool = (torch.randn((nb, hk, layers, 2, bs, d), generator=g) * 3).to(kv_dtype)
    layer = layer_view(pool, 0)
    table = torch.tensor([4, 1, 8, 6], dtype=torch.int32)
    k_scale = torch.tensor(0.37) if scales != "none" else None
    v_scale = torch.tensor(1.9) if scales == "both" else None
    for dtype in (torch.bfloat16, torch.float16):
        for ctx in (13, 16, 1):
            with force_fused(fused):
                k, v = lib.gather_prefix(layer, table, ctx, dtype, k_scale, v_scale)
            rk, rv = gather_seq(layer.contiguous(), table, ctx)
            assert k.dtype == v.dtype == dtype and k.shape == (ctx, hk, d) and k.is_contiguous()
            for got, want in ((k, dequantize(rk, dtype, k_scale)), (v, dequantize(rv, dtype, v_scale))):
                if fused and k.device.type == "cpu" and dtype == torch.bfloat16:
                    torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=0)
                else:
                    assert torch.equal(got, want)


def test_fp8_pools_take_the_library_only_where_switched_on(monkeypatch):
    monkeypatch.setattr(lib, "FP8_POOLS", False)
    assert lib.pool_ok(torch.bfloat16, torch.bfloat16) and not lib.pool_ok(torch.float8_e4m3fn, torch.bfloat16)
    assert not lib.pool_ok(torch.float16, torch.bfloat16)
    monkeypatch.setattr(lib, "FP8_POOLS", True)
    assert lib.pool_ok(torch.float8_e4m3fn, torch.bfloat16) and lib.pool_ok(torch.float8_e5m2, torch.float16)
    assert not lib.pool_ok(torch.float16, torch.bfloat16)


def test_padded_inputs_zero_only_uncovered_rows_and_pass_packed_ones(monkeypatch):
    monkeypatch.setattr(lib, "STRIDED_INPUTS", False)  # strided views are packed (test_strided_inputs_... has them on)
    g = torch.Generator().manual_seed(3)
    x = torch.randn((5, 2, 4), generator=g)
    y = torch.randn((3, 2, 4), generator=g)
    assert lib._padded([(x, 0)], 5) is x  # packed and of the call's length: no copy
    strided = torch.randn((5, 3, 2, 4), generator=g)[:, 1]  # a view whose rows skip other heads (q of a qkv)
    out = lib._padded([(strided, 0)], 5)
    assert out is not strided and torch.equal(out, strided)
    out = lib._padded([(y, 1), (x, 4)], 12)  # a dummy row, two parts, padding at the end
    assert torch.equal(out[0], torch.zeros(2, 4)) and torch.equal(out[1:4], y) and torch.equal(out[4:9], x)
    assert torch.equal(out[9:], torch.zeros(3, 2, 4))


def _torch_cudnn(q, k, v, scale, causal, lse):
    """cuDNN's call as library_prefill makes it ([1, H, L, D] views, grouped K/V heads), done in torch."""
    hq, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    o, lse_ = _attention_with_lse(q[0], k[0], v[0], scale, causal)
    return o.unsqueeze(0).to(q.dtype), lse_.unsqueeze(0).unsqueeze(-1)  # cuDNN's stats are [B, H, L, 1]


@pytest.mark.parametrize("buckets", [None, (16, 32)])
def test_library_path_matches_the_reference_backend(monkeypatch, buckets):
    """A fresh prompt, chunks on prefixes (block size 16; prefixes not block-aligned, one a multiple of the prefix
    bucket) and a decode row in one step, GQA 4; with the default buckets (no unmasked call at these lengths) and
    with small ones (dummy query rows, padding, the unmasked call and the merge)."""
    monkeypatch.setattr(lib, "_cudnn", _torch_cudnn)
    if buckets:
        monkeypatch.setattr(lib, "QUERY_BUCKET", buckets[0])
        monkeypatch.setattr(lib, "PREFIX_BUCKET", buckets[1])
    seq_lens, q_lens = [70, 93, 84, 1], [70, 40, 20, 1]
    p = make_problem(seq_lens, q_lens, hq=8, hk=2, d=32, bs=16, write_new=True)
    rows = [(0, 0, 70, 0), (1, 70, 40, 53), (2, 110, 20, 64)]  # below the GPU's length rule: the path is tested
    out = poisoned(p.q)
    lib.library_prefill(p.q, p.kv_layer, p.meta, rows, 0.3, p.k, p.v, out)
    ref = TorchAttentionBackend().attend(p.q, p.kv_layer, p.meta, 0.3, k_new=p.k, v_new=p.v)
    assert_close(out[:130], ref[:130], torch.float32, f"library path, buckets {buckets}")
    assert out[130:].isnan().all()  # the decode row is not the library's


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_library_path_over_an_fp8_pool_matches_the_reference_backend(monkeypatch, kv_dtype):
    """The same path over an fp8 pool (scales not 1): the prefix dequantized as it is gathered, the step's own K/V
    unquantized, as the reference attends (small buckets: both calls and the merge)."""
    monkeypatch.setattr(lib, "_cudnn", _torch_cudnn)
    monkeypatch.setattr(lib, "QUERY_BUCKET", 16)
    monkeypatch.setattr(lib, "PREFIX_BUCKET", 32)
    seq_lens, q_lens = [70, 93, 84], [70, 40, 20]
    p = make_problem(seq_lens, q_lens, hq=8, hk=2, d=32, bs=16, kv_dtype=kv_dtype, write_new=True)
    assert p.k_scale is not None and p.v_scale is not None
    rows = [(0, 0, 70, 0), (1, 70, 40, 53), (2, 110, 20, 64)]
    out = poisoned(p.q)
    lib.library_prefill(p.q, p.kv_layer, p.meta, rows, 0.3, p.k, p.v, out, p.k_scale, p.v_scale)
    ref = TorchAttentionBackend().attend(p.q, p.kv_layer, p.meta, 0.3, k_scale=p.k_scale, v_scale=p.v_scale,
                                         k_new=p.k, v_new=p.v)
    assert_close(out, ref, torch.float32, f"library path over {kv_dtype}")
    unscaled = poisoned(p.q)  # the scales are applied: leaving them out changes the answer
    lib.library_prefill(p.q, p.kv_layer, p.meta, rows, 0.3, p.k, p.v, unscaled)
    assert (unscaled[70:] - ref[70:]).abs().max() > 1e-3


@pytest.mark.parametrize("strided", [False, True])
def test_strided_inputs_go_to_the_call_where_they_lie(monkeypatch, strided):
    """STRIDED_INPUTS: call inputs that need no padding (a fresh row of a bucket's length; a chunk on a prefix at a
    prefix-bucket multiple) reach the call as views of the step's fused q/k/v, not copies; the answer is the
    reference's either way, and rows that need padding are still copied."""
    monkeypatch.setattr(lib, "STRIDED_INPUTS", strided)
    monkeypatch.setattr(lib, "QUERY_BUCKET", 16)
    monkeypatch.setattr(lib, "PREFIX_BUCKET", 32)
    calls = []

    def spy(q, k, v, scale, causal, lse):
        calls.append([x.untyped_storage().data_ptr() for x in (q, k, v)])
        return _torch_cudnn(q, k, v, scale, causal, lse)

    monkeypatch.setattr(lib, "_cudnn", spy)
    seq_lens, q_lens = [64, 96, 70], [64, 32, 20]
    p = make_problem(seq_lens, q_lens, hq=8, hk=2, d=32, bs=16, dtype=torch.bfloat16, write_new=True)
    step = p.q.untyped_storage().data_ptr()
    assert p.k.untyped_storage().data_ptr() == step and not lib._packed(p.q)  # views of one fused projection
    rows = [(0, 0, 64, 0), (1, 64, 32, 64), (2, 96, 20, 50)]
    out = poisoned(p.q)
    lib.library_prefill(p.q, p.kv_layer, p.meta, rows, 0.3, p.k, p.v, out)
    ref = TorchAttentionBackend().attend(p.q.float(), p.kv_layer, p.meta, 0.3, k_new=p.k.float(), v_new=p.v.float())
    assert_close(out.float(), ref, torch.bfloat16, f"strided inputs {strided}")
    # the fresh row's causal call; the chunk's causal call (k, v its own) and its unmasked one (q only is the step's)
    assert [c[0] == step for c in calls[:3]] == [strided] * 3
    assert [c[1] == step for c in calls[:2]] == [strided] * 2
    assert not any(step in c for c in calls[3:])  # the last row (20 tokens on 50) is padded: copies


def test_bucketed_shapes():
    assert lib.bucketed_shapes(8192, 0) == (0, 8192, 8192, 0)
    assert lib.bucketed_shapes(8000, 24576) == (24576, 8192, 8192, 0)
    assert lib.bucketed_shapes(8150, 20000) == (19456, 8192, 8704, 544)  # 544 + 8150 = 8694 -> 8704
    assert lib.bucketed_shapes(2049, 700) == (0, 2304, 2816, 700)


def test_transient_bound_covers_the_8b_shapes():
    b = lib.transient_bytes(8192, 40960, 32, 8, 128, torch.bfloat16)
    prefix = 2 * 40960 * 8 * 128 * 2
    assert prefix < b < prefix + 300 * 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,strided", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)])
def test_triton_backend_takes_cudnn_for_long_rows(dtype, strided, monkeypatch):
    """On CUDA (sm_90+), through the Triton backend's forward: cuDNN takes the prefill rows (a fresh prompt, chunks
    on prefixes beside decode rows), and the output matches the reference; with STRIDED_INPUTS, the rows that need
    no padding reach cuDNN as views of the fused q/k/v, which it takes as they are (no fallback to repeated K/V)."""
    from pdserve.ops.attention.triton_backend import TritonAttentionBackend

    if not lib.enabled(torch.device("cuda")):
        pytest.skip("cuDNN attention needs compute capability 9.0+")
    monkeypatch.setattr(lib, "STRIDED_INPUTS", strided)
    dev = torch.device("cuda")
    cases = (([lib.MIN_FRESH + 5], [lib.MIN_FRESH + 5]), ([lib.MIN_CHUNK + 2500, 300, 77], [lib.MIN_CHUNK, 1, 1]),
             ([8192 + 1000], [8192]),  # fresh; a chunk with both calls and the merge; a prefix under one bucket
             ([lib.MIN_CHUNK + 2 * lib.PREFIX_BUCKET], [lib.MIN_CHUNK]),  # aligned: one query copy for both calls
             ([8192], [8192]), ([8192 + 3 * lib.PREFIX_BUCKET, 500], [8192, 1]))  # no padding at all
    for seq_lens, q_lens in cases:
        p = make_problem(seq_lens, q_lens, hq=32, hk=8, d=128, bs=16, dtype=dtype, device=dev)
        out = TritonAttentionBackend().forward(p.q, p.k, p.v, p.kv_layer, p.meta, 128 ** -0.5)
        assert p.meta.library is not None and p.meta.library[0] is not None
        ref = TorchAttentionBackend().attend(p.q.float(), p.kv_layer.float(), p.meta, 128 ** -0.5,
                                             k_new=p.k.float(), v_new=p.v.float())
        assert_close(out.float(), ref, dtype, f"cuDNN rows {q_lens}")
    assert not lib._expand_kv, "cuDNN refused the grouped K/V views"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_backend_takes_cudnn_for_long_rows_over_an_fp8_pool(kv_dtype, monkeypatch):
    """FP8_POOLS on CUDA (sm_90+): the Triton backend's forward sends long prefill rows over an fp8 pool to cuDNN
    (the prefix dequantized by the gather kernel), and the output matches the reference and the Triton kernel's."""
    from pdserve.ops.attention.triton_backend import TritonAttentionBackend

    if not lib.enabled(torch.device("cuda")):
        pytest.skip("cuDNN attention needs compute capability 9.0+")
    dev = torch.device("cuda")
    cases = (([lib.MIN_FRESH + 5], [lib.MIN_FRESH + 5]), ([lib.MIN_CHUNK + 2500, 300, 77], [lib.MIN_CHUNK, 1, 1]),
             ([8192 + 1000], [8192]))
    for seq_lens, q_lens in cases:
        outs = {}
        for on in (True, False):
            monkeypatch.setattr(lib, "FP8_POOLS", on)
            p = make_problem(seq_lens, q_lens, hq=32, hk=4, d=128, bs=16, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                             device=dev)
            outs[on] = TritonAttentionBackend().forward(p.q, p.k, p.v, p.kv_layer, p.meta, 128 ** -0.5,
                                                        k_scale=p.k_scale, v_scale=p.v_scale)
            assert (p.meta.library is not None and p.meta.library[0] is not None) == on
        ref = TorchAttentionBackend().attend(p.q.float(), p.kv_layer, p.meta, 128 ** -0.5, k_scale=p.k_scale,
                                             v_scale=p.v_scale, k_new=p.k.float(), v_new=p.v.float())
        assert_close(outs[True].float(), ref, torch.bfloat16, f"cuDNN rows over {kv_dtype}, {q_lens}")
        assert_close(outs[True].float(), outs[False].float(), torch.bfloat16, f"cuDNN against Triton, {q_lens}")


def test_warm_shapes_cover_fresh_buckets_and_full_chunks():
    shapes = lib.warm_shapes(8192, 40960)
    fresh = [n for n, c in shapes if c == 0]
    assert fresh == list(range(2048, 8193, 256))
    shifted = lib.shifted_chunks(8192, 40960)
    assert shapes[-len(shifted):] == shifted
    chunks = shapes[len(fresh):-len(shifted)]
    assert [c for n, c in chunks] == list(range(1024, 32769, 1024)) and all(n == 8192 for n, c in chunks)
    assert lib.warm_shapes(1000, 4096) == []  # no row of such an engine takes the library
    assert lib.warm_shapes(3000, 4096) == [(n, 0) for n in (2048, 2304, 2560, 2816)] + [(3000, 0)]
    assert len(lib.warm_shapes(8192, 10 ** 6)) == 25 + lib.WARM_MAX_PREFIXES + 4


def test_shifted_chunks_cover_every_causal_size_of_a_full_chunk_on_an_unaligned_prefix():
    """Decode rows shift a long prompt's chunks off the prefix buckets: a chunk of up to max_tokens on a prefix r
    tokens past a bucket makes a causal call of round_up(r + chunk) rows; every size it can take has a warm row."""
    for max_tokens in (8192, 6000, 4096):
        rows = lib.shifted_chunks(max_tokens, 40960)
        assert {lib.bucketed_shapes(n, c)[2] for n, c in rows} == {
            lib.bucketed_shapes(max_tokens, 1024 + r)[2] for r in range(1, lib.PREFIX_BUCKET)}
        # the calls of the warm rows on a prefix: unmasked (query rows, prefix keys), causal with log-sum-exps (size)
        warm = [lib.bucketed_shapes(n, c) for n, c in lib.warm_shapes(max_tokens, 40960) if c]
        unmasked, causal = {(qa, c0) for c0, qa, _, _ in warm}, {sb for _, _, sb, _ in warm}
        full_qa = lib.bucketed_shapes(max_tokens, 0)[1]
        for q_len in range(max_tokens, lib.MIN_CHUNK - 1, -1):  # a full chunk less the step's decode rows
            for c in (1024, 1025, 1224, 5120 + 511, 9216 + 1023):
                c0, qa, sb, _ = lib.bucketed_shapes(q_len, c)
                if qa == full_qa and c + q_len <= 40960:
                    assert (qa, c0) in unmasked and sb in causal, (max_tokens, q_len, c)
    assert lib.shifted_chunks(3000, 40960) == []  # no full chunk takes the library below MIN_CHUNK
    assert lib.shifted_chunks(8192, 8192 + 2047) == []  # no prompt reaches a bucket past the chunk


def test_warm_shapes_add_the_long_prefill_cap_chunks():
    base = lib.warm_shapes(8192, 40960)
    capped = lib.warm_shapes(8192, 40960, chunk=2048)
    extra = [x for x in capped if x not in base]
    assert [x for x in capped if x in base] == base  # everything without a cap, in the same order
    assert extra == [(2048, c) for c in range(1024, 38913, 1024)][:lib.WARM_MAX_PREFIXES]
    # a cap the Triton kernel takes (below MIN_PLANNED), or one no smaller than the step, adds nothing
    assert lib.warm_shapes(8192, 40960, chunk=lib.MIN_PLANNED - 1) == base
    assert (lib.MIN_PLANNED, 1024) in lib.warm_shapes(8192, 40960, chunk=lib.MIN_PLANNED)
    assert lib.warm_shapes(8192, 40960, chunk=8192) == base == lib.warm_shapes(8192, 40960, chunk=9000)


def test_warm_up_is_a_no_op_without_the_library():
    assert lib.warm_up(torch.device("cpu"), torch.bfloat16, 8, 2, 64, 8192, 40960) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_builds_every_shape_on_cuda():
    if not lib.enabled(torch.device("cuda")):
        pytest.skip("cuDNN attention needs compute capability 9.0+")
    n = lib.warm_up(torch.device("cuda"), torch.bfloat16, 32, 8, 128, 4096, 8192)
    assert n == len(lib.warm_shapes(4096, 8192)) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_over_an_fp8_pool_sends_long_prompts_to_cudnn_and_tracks_triton(monkeypatch):
    """A whole engine (dummy Qwen3-0.6B, bf16, fp8 KV): a fresh 3000-token prompt and a 9000-token one chunked by
    4096 on its prefix. With FP8_POOLS the library takes prefill rows, and every request's first-token logits track
    the run with the Triton kernel for every row (the same fp8 pool; only the attention kernel differs)."""
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.ops.attention import triton_backend
    from pdserve.sampling_params import SamplingParams
    from tests.engine.test_vs_transformers import capture_logits, run_to_end

    if not lib.enabled(torch.device("cuda")):
        pytest.skip("cuDNN attention needs compute capability 9.0+")
    calls = []
    real = triton_backend.library_prefill

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "library_prefill", counted)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(lib, "FP8_POOLS", on)
        calls.clear()
        core = EngineCore(EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
                                       kv_cache_dtype="fp8", num_gpu_blocks=1024, max_num_batched_tokens=4096,
                                       max_num_seqs=4, max_model_len=12288, enforce_eager=True))
        captured = capture_logits(core)
        g = torch.Generator().manual_seed(3)
        for i, n in enumerate([3000, 9000]):
            core.add_request(str(i), torch.randint(0, 151000, (n,), generator=g).tolist(),
                             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        run_to_end(core)
        runs[on] = (captured, len(calls))
        del core
        torch.cuda.empty_cache()
    assert runs[False][1] == 0 and runs[True][1] > 0, (runs[False][1], runs[True][1])
    for rid, rows in runs[False][0].items():
        (n, x), (_, y) = runs[True][0][rid][0], rows[0]
        err = float((x - y).abs().max() / y.abs().max())
        assert err < 0.05, (rid, n, err)

"""The split-K paged decode kernel against the torch reference: random pools with shuffled block tables, GQA 1/4/8,
head dims 64/128/256 (and a padded 80), block sizes 16/32, ragged lengths across block boundaries, sliding
windows, softcapping, fp8 pools (read and widened in the kernel), one and several splits, decode-only and mixed
batches (rows with more new tokens must stay untouched: the output is poisoned with NaN), padded rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.layers import RotaryEmbedding
from pdserve.ops.attention import decode as D
from pdserve.ops.attention.common import KVTarget, QKRope, is_fp8
from pdserve.ops.attention.decode import paged_decode
from pdserve.ops.attention.torch_ref import TorchAttentionBackend
from pdserve.ops.rotary import qk_norm_rope_triton
from tests.ops.attention_helpers import TOL, assert_close, gpu, make_problem, poisoned, row_kinds


def _reference(p, scale, window, softcap):
    layer = p.kv_layer if is_fp8(p.kv_layer.dtype) else p.kv_layer.float()
    return TorchAttentionBackend().attend(p.q.float(), layer, p.meta, scale, window, softcap, p.k_scale, p.v_scale)


def _run(p, scale, window=None, softcap=None, mixed=False, splits=None, prefetch=None, tile=None):
    m = p.meta
    out = poisoned(p.q)
    paged_decode(p.q, p.kv_layer, m.block_tables, m.seq_lens_t, m.max_seq_len, scale, window, softcap,
                 p.k_scale, p.v_scale, query_start_loc=m.query_start_loc_t if mixed else None, out=out,
                 num_splits=splits, prefetch=prefetch, tile=tile)
    return out


CPU_CASES = [
    # hq, hk, d, bs, dtype, kv_dtype, window, softcap, splits
    (2, 2, 64, 16, torch.float32, None, None, None, None),
    (8, 2, 128, 32, torch.float32, None, 37, None, 1),
    (8, 1, 256, 16, torch.float16, None, None, None, 3),
    (8, 2, 64, 16, torch.float16, None, None, 4.0, 2),
    (4, 1, 80, 16, torch.float32, None, 20, None, None),
    (8, 2, 64, 32, torch.float32, torch.float8_e4m3fn, None, None, 2),
    (4, 4, 64, 16, torch.float16, torch.float8_e5m2, 50, None, None),
]


@pytest.mark.parametrize("hq,hk,d,bs,dtype,kv_dtype,window,softcap,splits", CPU_CASES)
def test_decode_matches_reference(hq, hk, d, bs, dtype, kv_dtype, window, softcap, splits):
    p = make_problem([1, 17, 130, 64, 45], [1] * 5, hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype,
                     seed=hq + d + bs)
    assert p.meta.decode_only
    scale = d ** -0.5
    out = _run(p, scale, window, softcap, splits=splits)
    assert_close(out, _reference(p, scale, window, softcap), dtype, "decode")


@pytest.mark.parametrize("hq,hk,d,bs,dtype,kv_dtype,window,softcap,splits", CPU_CASES[1:4] + CPU_CASES[5:6])
def test_block_table_read_a_tile_ahead_matches_reference(hq, hk, d, bs, dtype, kv_dtype, window, softcap, splits):
    """The kernel's PREFETCH_BT loop (the next tile's page ids loaded before this tile's K/V) in every mode: windows,
    softcapping, several splits (empty ones included: 1-key rows), an fp8 pool, and mixed batches below."""
    p = make_problem([1, 17, 130, 64, 45], [1] * 5, hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype,
                     seed=hq + d + bs + 1)
    scale = d ** -0.5
    out = _run(p, scale, window, softcap, splits=splits, prefetch=True)
    assert_close(out, _reference(p, scale, window, softcap), dtype, "decode, block table read ahead")


def test_block_table_read_ahead_is_the_many_program_default():
    cpu = torch.device("cpu")
    p = make_problem([40] * 16, [1] * 16, hq=4, hk=2, d=32, bs=16, dtype=torch.float16, seed=3)
    seen = []
    real = D._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw["PREFETCH_BT"])
                return real[grid](*a, **kw)
            return launch

    D._decode_kernel = Spy()
    try:
        _run(p, 0.2, splits=1)  # 16 rows x 2 heads: 32 programs, MANY_PROGRAM_WAVES waves of 8 SMs
        _run(p, 0.2, splits=1, prefetch=False)
        m = p.meta
        paged_decode(p.q[:4], p.kv_layer, m.block_tables[:4], m.seq_lens_t[:4], m.max_seq_len, 0.2, num_splits=1)
    finally:
        D._decode_kernel = real
    assert D.decode_tile(32, torch.float16, False, 16, 32, cpu) == D.MANY_PROGRAMS_TILE
    assert seen == [D.MANY_PROGRAMS_PREFETCH, False, False]  # fewer programs: the table's tiles, no read ahead


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("prefetch", [None, True])
def test_mixed_batch_leaves_prefill_rows_alone(splits, prefetch):
    p = make_problem([33, 70, 9, 120, 16], [1, 20, 1, 5, 16], hq=8, hk=2, d=64, bs=16, seed=11)
    out = _run(p, 0.125, mixed=True, splits=splits, prefetch=prefetch)
    dec, pre = row_kinds(p.meta)
    assert torch.isnan(out[pre]).all()
    assert_close(out[dec], _reference(p, 0.125, None, None)[dec], torch.float32, "mixed decode rows")


def test_many_programs_take_the_many_program_tile():
    cpu = torch.device("cpu")  # the Triton interpreter counts 8 SMs: 32 programs are MANY_PROGRAM_WAVES waves
    assert D.num_sms(cpu) * D.MANY_PROGRAM_WAVES == 32
    assert D.decode_tile(64, torch.float16, False, 16, 32, cpu) == D.MANY_PROGRAMS_TILE
    assert D.decode_tile(64, torch.float16, False, 16, 31, cpu) == D.DECODE_TILES[(False, True)]
    assert D.decode_tile(64, torch.float16, True, 16, 64, cpu) == D.MANY_PROGRAMS_TILE_FP8  # fp8: its own
    assert D.decode_tile(64, torch.float16, True, 16, 31, cpu) == D.DECODE_TILES[(True, True)]
    assert D.many_program_rows(2, cpu) == 16


@pytest.mark.parametrize("mixed", [False, True])
def test_fp8_pool_takes_its_own_many_program_tile(mixed, monkeypatch):
    """MANY_PROGRAMS_TILE_FP8: an fp8 pool's launches of MANY_PROGRAM_WAVES waves take that tile and read the block
    table a tile ahead (as MANY_PROGRAMS_PREFETCH says); None keeps the table's fp8 tiles without it. The outputs
    stay the reference's either way."""
    cpu = torch.device("cpu")
    p = make_problem([40, 17, 1, 64, 33, 16, 90, 5] * 2, [1] * 16, hq=4, hk=2, d=32, bs=16, dtype=torch.float16,
                     kv_dtype=torch.float8_e4m3fn, seed=21)
    seen = []
    real = D._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append((kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["PREFETCH_BT"]))
                return real[grid](*a, **kw)
            return launch

    monkeypatch.setattr(D, "_decode_kernel", Spy())
    monkeypatch.setattr(D, "MANY_PROGRAMS_TILE_FP8", None)
    assert D.decode_tile(32, torch.float16, True, 16, 32, cpu) == D.DECODE_TILES[(True, True)]
    assert D.many_program_split_rows(2, 4096, cpu, fp8=True) == 0
    ref = _reference(p, 0.2, None, None)
    assert_close(_run(p, 0.2, mixed=mixed, splits=1), ref, torch.float16, "fp8 pool, the table's tile")
    monkeypatch.setattr(D, "MANY_PROGRAMS_TILE_FP8", (32, 4, 3))
    assert D.decode_tile(32, torch.float16, True, 16, 32, cpu) == (32, 4, 3)
    assert D.decode_tile(32, torch.float16, True, 16, 31, cpu) == D.DECODE_TILES[(True, True)]
    assert D.many_program_split_rows(2, 4096, cpu, fp8=True) == D.many_program_split_rows(2, 4096, cpu) == 2
    out = _run(p, 0.2, mixed=mixed, splits=1)  # 16 rows x 2 heads: 32 programs, the waves of 8 SMs
    assert_close(out, ref, torch.float16, "fp8 pool, its many-program tile")
    assert seen == [(*D.DECODE_TILES[(True, True)], False), (32, 4, 3, D.MANY_PROGRAMS_PREFETCH)]


def test_many_program_split_rows_is_the_fewest_rows_taking_that_tile_with_splits(monkeypatch):
    cpu = torch.device("cpu")  # 32 programs are the waves on the interpreter's 8 SMs
    waves = D.num_sms(cpu) * D.MANY_PROGRAM_WAVES
    for hk, seq in ((2, 4096), (8, 4096), (3, 4096), (2, 100)):
        rows = D.many_program_split_rows(hk, seq, cpu)
        takes = [r for r in range(2, D.many_program_rows(hk, cpu))
                 if (s := D.decode_splits(r, hk, seq, None, cpu)) > 1 and r * hk * s >= waves
                 and D.decode_tile(64, torch.float16, False, r, r * hk * s, cpu) == D.MANY_PROGRAMS_TILE]
        assert rows == (takes[0] if takes else 0), (hk, seq, rows, takes)
    assert D.many_program_split_rows(2, 4096, cpu) == 2  # 2 rows x 2 heads x 8 splits
    assert D.many_program_split_rows(8, 64, cpu) == 0  # 64 keys: one split at any row count
    # Qwen3-8B's 8 KV heads on a 132-SM H200: 2 rows of a 16k prompt's chunks take 33 splits (528 programs)
    monkeypatch.setattr(D, "num_sms", lambda device: 132)
    assert D.many_program_split_rows(8, 2 * 8192 + 17, cpu) == 2
    assert D.decode_splits(6, 8, 1024, None, cpu) * 6 * 8 == 528  # 6 rows of 1k: the variant lease_s18 compiled


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_of_many_rows_matches_reference(mixed):
    """16 rows x 2 KV heads, one split: the many-program tile (64 keys, the block table read ahead) on the
    interpreter's 8 SMs."""
    lens = [1, 17, 130, 64, 45, 16, 33, 200, 90, 2, 31, 64, 65, 120, 7, 80]
    q_lens = [1] * 16 if not mixed else [1] * 7 + [20] + [1] * 8
    p = make_problem(lens, q_lens, hq=8, hk=2, d=64, bs=16, dtype=torch.float16, seed=5)
    out = _run(p, 0.125, mixed=mixed, splits=1)
    ref = _reference(p, 0.125, None, None)
    if mixed:
        dec, pre = row_kinds(p.meta)
        assert torch.isnan(out[pre]).all()
        out, ref = out[dec], ref[dec]
    assert_close(out, ref, torch.float16, "decode, many programs")


def test_padded_rows_give_zeros_and_read_nothing():
    # padded rows: KV length 0 and block table -1 (a negative block must never be addressed)
    p = make_problem([40, 3], [1, 1], hq=4, hk=2, d=32, bs=16, pad={"num_tokens": 4, "num_seqs": 4})
    assert p.meta.decode_only and p.meta.block_tables[2:].eq(-1).all()
    out = _run(p, 0.2, splits=2)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert_close(out[:2], _reference(p, 0.2, None, None)[:2], torch.float32, "padded batch")


GPU_CASES = [
    # hq, hk, d, bs, dtype, kv_dtype, window
    (32, 8, 128, 16, torch.bfloat16, None, None),
    (32, 8, 128, 16, torch.float16, None, None),
    (32, 8, 128, 16, torch.float32, None, None),
    (32, 8, 128, 16, torch.bfloat16, torch.float8_e4m3fn, None),
    (32, 8, 128, 32, torch.bfloat16, torch.float8_e5m2, None),
    (8, 4, 256, 16, torch.bfloat16, None, 512),
    (8, 4, 256, 16, torch.bfloat16, torch.float8_e4m3fn, 512),
    (64, 8, 128, 16, torch.bfloat16, None, None),
    (16, 16, 64, 32, torch.bfloat16, None, None),
]


@gpu
@pytest.mark.parametrize("hq,hk,d,bs,dtype,kv_dtype,window", GPU_CASES)
@pytest.mark.parametrize("lens", [[1, 17, 1000, 4097, 300], [32768, 20000], [777] * 64, [300, 1500] * 40])
def test_decode_matches_reference_cuda(hq, hk, d, bs, dtype, kv_dtype, window, lens):
    p = make_problem(lens, [1] * len(lens), hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype, seed=len(lens))
    scale = d ** -0.5
    ref = _reference(p, scale, window, None)
    assert_close(_run(p, scale, window), ref, dtype, "decode")
    assert_close(_run(p, scale, window, splits=1), ref, dtype, "decode, one split")


@gpu
@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_many_program_tiles_cuda(kv_dtype, widen, monkeypatch):
    """Qwen3-30B-A3B's attention shape (32 query heads over 4 KV heads, d=128) on an fp8 pool, 160 ragged rows (640
    programs of one split: MANY_PROGRAM_WAVES waves on an H200): the engine's choice, and tiles of 64 to 256 keys
    with the block table read a tile ahead, V widened by `.to` and by inline PTX (FP8_V_WIDEN), against the
    reference."""
    monkeypatch.setattr(D, "FP8_V_WIDEN", widen)
    lens = [1024, 1, 17, 2048, 777] * 32
    p = make_problem(lens, [1] * len(lens), hq=32, hk=4, d=128, bs=16, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                     seed=9)
    scale = 128 ** -0.5
    ref = _reference(p, scale, None, None)
    assert_close(_run(p, scale), ref, torch.bfloat16, "decode, the engine's tile")
    for tile in [(64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 2)]:
        assert_close(_run(p, scale, splits=1, tile=tile, prefetch=True), ref, torch.bfloat16, f"decode, {tile}")


@gpu
@pytest.mark.parametrize("hq,hk,d,bs,dtype,kv_dtype,window", [c for c in GPU_CASES if c[5] is not None])
@pytest.mark.parametrize("lens", [[1, 17, 1000, 4097, 300], [32768, 20000], [300, 1500] * 40])
def test_fp8_v_widened_by_ptx_cuda(hq, hk, d, bs, dtype, kv_dtype, window, lens, monkeypatch):
    """FP8_V_WIDEN: V tiles widened by the kernel's inline PTX (_widen_fp8), e4m3 and e5m2, head dims 128 and 256,
    a window, one row to many, one split and several, decode-only and mixed: the same output as the `.to`'s, and
    the reference's."""
    p = make_problem(lens, [1] * len(lens), hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype, seed=len(lens))
    scale = d ** -0.5
    ref = _reference(p, scale, window, None)
    for mixed in (False, True):
        for splits in (None, 1):
            monkeypatch.setattr(D, "FP8_V_WIDEN", False)
            monkeypatch.setattr(D, "FP8_V_WIDEN_FEW", False)
            plain = _run(p, scale, window, mixed=mixed, splits=splits)
            monkeypatch.setattr(D, "FP8_V_WIDEN", True)
            monkeypatch.setattr(D, "FP8_V_WIDEN_FEW", True)
            assert D.v_widen(p.q, p.kv_layer.dtype, False) == (2 if kv_dtype == torch.float8_e5m2 else 1)
            out = _run(p, scale, window, mixed=mixed, splits=splits)
            assert_close(out, ref, dtype, f"decode, V widened by PTX, mixed {mixed}, splits {splits}")
            torch.testing.assert_close(out, plain, atol=TOL[dtype], rtol=TOL[dtype])


def test_fp8_v_widen_needs_cuda(monkeypatch):
    monkeypatch.setattr(D, "FP8_V_WIDEN", True)
    monkeypatch.setattr(D, "FP8_V_WIDEN_FEW", True)
    q = torch.zeros((2, 4, 32), dtype=torch.float16)
    assert D.v_widen(q, torch.float8_e4m3fn, True) == D.v_widen(q, torch.float8_e4m3fn, False) == 0  # no inline PTX
    assert D.v_widen(q, torch.float16, True) == 0


@gpu
def test_fp8_v_widen_where_switched_on_cuda(monkeypatch):
    q = torch.zeros((2, 4, 32), dtype=torch.bfloat16, device="cuda")
    assert D.v_widen(q, torch.float8_e4m3fn, True) == (1 if D.FP8_V_WIDEN else 0)  # many-program launches
    assert D.v_widen(q, torch.float8_e5m2, False) == (2 if D.FP8_V_WIDEN_FEW else 0)  # the others
    assert D.v_widen(q, torch.bfloat16, True) == 0
    assert D.v_widen(q.float(), torch.float8_e4m3fn, True) == 0  # fp32 queries: the FMA units' dots


@gpu
def test_decode_softcap_and_mixed_cuda():
    p = make_problem([5000, 3000, 64, 1], [1, 700, 1, 1], hq=16, hk=8, d=256, bs=16, dtype=torch.bfloat16, seed=2)
    out = _run(p, 0.0625, 1024, 50.0, mixed=True)
    dec, pre = row_kinds(p.meta)
    assert torch.isnan(out[pre]).all()
    assert_close(out[dec], _reference(p, 0.0625, 1024, 50.0)[dec], torch.bfloat16, "mixed softcap")


def _rope_inputs(p, d: int, norm: bool, offset: float, seed: int):
    """The rotary tables (float32, as RotaryEmbedding's), the rows' positions and the norm weights of a problem."""
    g = torch.Generator().manual_seed(seed)
    tables = RotaryEmbedding(d, 10000.0, max(p.meta.seq_lens) + 8)
    dev = p.q.device
    positions = (p.meta.seq_lens_t.long() - 1).clamp_min(0)
    qw = kw = None
    if norm:
        qw, kw = (torch.randn(d, generator=g).to(dev, p.q.dtype) for _ in range(2))
    return QKRope(positions, tables.cos.to(dev), tables.sin.to(dev), qw, kw, 1e-6, offset)


def _rope_then_decode(p, rope, scale, window=None, softcap=None, splits=None):
    """The path without the fold: the rotary kernel (norm, rotary, K/V into the pool), then the decode kernel."""
    layer = p.fresh_layer()
    q, k = qk_norm_rope_triton(p.q.clone(), p.k.clone(), rope.positions, rope.cos, rope.sin, rope.q_weight,
                               rope.k_weight, rope.eps, rope.offset, v=p.v,
                               kv=KVTarget(layer, p.meta.slot_mapping, p.k_scale, p.v_scale))
    m = p.meta
    out = paged_decode(q, layer, m.block_tables, m.seq_lens_t, m.max_seq_len, scale, window, softcap, p.k_scale,
                       p.v_scale, out=poisoned(p.q), num_splits=splits)
    return out, layer


def _decode_with_rope(p, rope, scale, window=None, softcap=None, splits=None, tile=None):
    layer = p.fresh_layer()
    q, k, v = p.q.clone(), p.k.clone(), p.v.clone()
    m = p.meta
    out = paged_decode(q, layer, m.block_tables, m.seq_lens_t, m.max_seq_len, scale, window, softcap, p.k_scale,
                       p.v_scale, out=poisoned(p.q), num_splits=splits, tile=tile, rope=rope, k=k, v=v,
                       slot_mapping=m.slot_mapping)
    assert torch.equal(q, p.q) and torch.equal(k, p.k) and torch.equal(v, p.v), "q/k/v are read, not written"
    return out, layer


ROPE_CASES = [
    # hq, hk, d, bs, dtype, window, softcap, splits, norm, offset
    (8, 2, 64, 16, torch.float16, None, None, 3, True, 0.0),  # the newest key in a split's first tile
    (8, 2, 64, 16, torch.float16, None, None, 1, True, 1.0),  # ... and in a later one; Gemma's 1 + weight
    (4, 4, 32, 16, torch.float32, None, None, None, False, 0.0),  # no norm (Llama: the kernel can; not chosen)
    (8, 1, 128, 32, torch.float16, 37, None, 2, True, 0.0),
    (8, 2, 64, 16, torch.float16, None, 4.0, 2, True, 0.0),
]


@pytest.mark.parametrize("hq,hk,d,bs,dtype,window,softcap,splits,norm,offset", ROPE_CASES)
def test_rope_in_the_decode_kernel_matches_the_rotary_kernel_then_decode(hq, hk, d, bs, dtype, window, softcap,
                                                                         splits, norm, offset):
    """ROPE_IN_DECODE's kernel path: from the q/k/v product's output (q, k, v as views of one tensor), the output and
    the pool (the new K/V at every row's slot, nothing else) as the rotary kernel's write then the decode kernel's.
    Rows of 1, 17, 130, 64 and 65 keys put the newest key in a split's first tile, in a later tile, at a tile's edge
    and alone in its split (1-key rows over several splits leave splits with no keys)."""
    p = make_problem([1, 17, 130, 64, 65], [1] * 5, hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, seed=hq + d + bs + 5)
    rope = _rope_inputs(p, d, norm, offset, seed=d)
    scale = d ** -0.5
    ref, ref_layer = _rope_then_decode(p, rope, scale, window, softcap, splits)
    out, layer = _decode_with_rope(p, rope, scale, window, softcap, splits)
    assert_close(out, ref, dtype, "decode with the rotary in the kernel")
    slots = torch.as_tensor(p.slots)
    for pool in (layer, ref_layer):
        changed = (pool != p.kv_layer).any(-1).any(-1).any(1)  # [blocks, bs]: a slot whose K or V changed
        assert sorted(changed.nonzero()[:, 0] * bs + changed.nonzero()[:, 1]) == sorted(slots.tolist())
    torch.testing.assert_close(layer, ref_layer, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("splits", [1, 3])
def test_rope_in_the_decode_kernel_on_an_fp8_pool(kv_dtype, splits, monkeypatch):
    """ROPE_IN_DECODE_FP8: on an fp8 pool the kernel stores the new key and value as the rotary kernel does (the
    16-bit key / k_scale, saturated, nearest even) and attends to the key as stored: the pool bit for bit and the
    output as the rotary kernel then the decode kernel give them."""
    monkeypatch.setattr(D, "ROPE_IN_DECODE_FP8", True)
    p = make_problem([1, 17, 130, 64, 65], [1] * 5, hq=8, hk=2, d=64, bs=16, dtype=torch.float16, kv_dtype=kv_dtype,
                     seed=31 + splits)
    rope = _rope_inputs(p, 64, True, 0.0, seed=5)
    assert D.rope_in_decode(p.q, p.kv_layer, rope)
    ref, ref_layer = _rope_then_decode(p, rope, 0.125, splits=splits)
    out, layer = _decode_with_rope(p, rope, 0.125, splits=splits)
    assert_close(out, ref, torch.float16, "decode with the rotary in the kernel, fp8 pool")
    new = (layer.view(torch.uint8) != p.kv_layer.view(torch.uint8)).any(-1).any(-1).any(1).nonzero()
    assert sorted((new[:, 0] * 16 + new[:, 1]).tolist()) == sorted(torch.as_tensor(p.slots).tolist()), \
        "the rows' slots written, nothing else"
    assert torch.equal(layer.view(torch.uint8), ref_layer.view(torch.uint8)), "the pool as the rotary kernel writes it"
    monkeypatch.setattr(D, "ROPE_IN_DECODE_FP8", False)
    assert not D.rope_in_decode(p.q, p.kv_layer, rope)


def test_rope_in_the_decode_kernel_with_padded_rows_and_many_rows():
    """Padded rows (length 0, slot -1) write nothing and give zeros; a step of many rows (one split)."""
    p = make_problem([40, 3], [1, 1], hq=4, hk=2, d=32, bs=16, pad={"num_tokens": 4, "num_seqs": 4})
    rope = _rope_inputs(p, 32, True, 0.0, seed=1)
    out, layer = _decode_with_rope(p, rope, 0.2, splits=2)
    ref, ref_layer = _rope_then_decode(p, rope, 0.2, splits=2)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert_close(out[:2], ref[:2], torch.float32, "padded batch with the rotary in the kernel")
    torch.testing.assert_close(layer, ref_layer, atol=1e-5, rtol=1e-5)
    lens = [1 + (i * 37) % 300 for i in range(40)]
    p = make_problem(lens, [1] * 40, hq=8, hk=2, d=64, bs=16, dtype=torch.float16, seed=9)
    rope = _rope_inputs(p, 64, True, 0.0, seed=2)
    out, layer = _decode_with_rope(p, rope, 0.125, splits=1)
    ref, ref_layer = _rope_then_decode(p, rope, 0.125, splits=1)
    assert_close(out, ref, torch.float16, "many rows, the rotary in the kernel")
    torch.testing.assert_close(layer, ref_layer, atol=1e-2, rtol=1e-2)


def test_rope_in_decode_only_where_it_can(monkeypatch):
    p = make_problem([33, 70], [1, 20], hq=4, hk=2, d=32, bs=16, dtype=torch.float16, seed=3)
    rope = _rope_inputs(p, 32, True, 0.0, seed=3)
    m = p.meta
    with pytest.raises(ValueError, match="decode-only"):  # a mixed launch: its prefill rows need the rotary kernel
        paged_decode(p.q, p.kv_layer, m.block_tables, m.seq_lens_t, m.max_seq_len, 0.2, rope=rope, k=p.k, v=p.v,
                     slot_mapping=m.slot_mapping, query_start_loc=m.query_start_loc_t)
    monkeypatch.setattr(D, "ROPE_IN_DECODE", True)
    fp8_pool = torch.zeros((4, 2, 16, 2, 32), dtype=torch.float8_e4m3fn)
    assert D.rope_in_decode(p.q, p.kv_layer, rope)
    monkeypatch.setattr(D, "ROPE_IN_DECODE_FP8", False)
    assert not D.rope_in_decode(p.q, fp8_pool, rope)
    monkeypatch.setattr(D, "ROPE_IN_DECODE_FP8", True)  # as shipped: on the interpreter, and on CUDA with V by PTX
    assert p.q.shape[0] >= 8 and D.DECODE_TILES[(True, True)][0] > D.ROPE_FP8_MAX_KEYS
    assert D.rope_in_decode(p.q[:7], fp8_pool, rope)  # a few rows: the (64, 4, 3) tile
    assert not D.rope_in_decode(p.q, fp8_pool, rope)  # 8 rows or more: the 128-key tile keeps the rotary kernel
    assert D.rope_in_decode(p.q, p.kv_layer, rope)  # (a 16-bit pool: any launch below the many-program waves)
    monkeypatch.setattr(D, "ROPE_IN_DECODE_FP8", False)
    assert not D.rope_in_decode(p.q, p.kv_layer, QKRope(rope.positions, rope.cos, rope.sin))  # no QK-norm (Llama)
    wide = torch.zeros((1, 2, 256))
    assert not D.rope_in_decode(wide, torch.zeros((4, 2, 16, 2, 256)), rope)  # head dim 256 (Gemma 3)
    assert not D.rope_in_decode(p.q[..., :24], p.kv_layer[..., :24], rope)  # 24: not a power of two
    monkeypatch.setattr(D, "num_sms", lambda device: 8)  # as on CPU, also for the fp16 case's device check
    assert not D.rope_in_decode(p.q, p.kv_layer, rope, D.MANY_PROGRAM_WAVES * 8)  # a batch-256-like launch
    assert D.rope_in_decode(p.q, p.kv_layer, rope, D.MANY_PROGRAM_WAVES * 8 - 1)
    monkeypatch.setattr(D, "ROPE_IN_DECODE", False)
    assert not D.rope_in_decode(p.q, p.kv_layer, rope)


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("lens", [[8192], [1, 17, 1000, 4097, 300], [777] * 64])
def test_rope_in_the_decode_kernel_on_an_fp8_pool_cuda(kv_dtype, lens, monkeypatch):
    """ROPE_IN_DECODE_FP8 with FP8_V_WIDEN_FEW (as shipped): Qwen3-30B-A3B's attention shape (32 query heads over 4
    KV heads, d=128) on an fp8 pool, the decode kernel's rotary and quantized K/V write against the rotary kernel then
    the decode kernel: the same pool bytes nearly everywhere, the output within bf16's tolerance. The engine takes it
    below 8 rows (ROPE_FP8_MAX_KEYS); the kernel itself also at 64 rows, with the 128-key tile."""
    monkeypatch.setattr(D, "ROPE_IN_DECODE_FP8", True)
    monkeypatch.setattr(D, "FP8_V_WIDEN_FEW", True)
    p = make_problem(lens, [1] * len(lens), hq=32, hk=4, d=128, bs=16, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                     seed=len(lens) + 17)
    rope = _rope_inputs(p, 128, True, 0.0, seed=13)
    assert D.rope_in_decode(p.q, p.kv_layer, rope, len(lens) * 4) == (len(lens) < 8)
    ref, ref_layer = _rope_then_decode(p, rope, 128 ** -0.5)
    out, layer = _decode_with_rope(p, rope, 128 ** -0.5)
    assert_close(out, ref, torch.bfloat16, "decode with the rotary in the kernel, fp8 pool")
    a, b, before = (x.view(torch.uint8) for x in (layer, ref_layer, p.kv_layer))
    assert (a != b).sum() <= (a != before).sum() // 100, "nearly every new key's bytes as the rotary kernel's"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[8192], [1, 17, 1000, 4097, 300], [32768, 20000], [777] * 64])
def test_rope_in_the_decode_kernel_cuda(dtype, lens):
    """Qwen3-8B's attention shape (32 query heads, 8 KV heads, d=128): the decode kernel's rotary and K/V write
    (held to ROPE_MAXNREG registers at the one-row tile) against the rotary kernel then the decode kernel, at one row
    of 8k (64 splits), ragged rows, long rows and 64 rows (the 128-key tile)."""
    p = make_problem(lens, [1] * len(lens), hq=32, hk=8, d=128, bs=16, dtype=dtype, seed=len(lens) + 7)
    rope = _rope_inputs(p, 128, True, 0.0, seed=11)
    ref, ref_layer = _rope_then_decode(p, rope, 128 ** -0.5)
    out, layer = _decode_with_rope(p, rope, 128 ** -0.5)
    assert_close(out, ref, dtype, "decode with the rotary in the kernel")
    torch.testing.assert_close(layer, ref_layer, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    assert (layer != ref_layer).sum() <= (layer != p.kv_layer).sum() // 100, "nearly every new key bit for bit"

"""The varlen paged prefill kernel against the torch reference: whole prompts and chunks on a prefix in the pool,
several prompts in one launch, GQA 1/4/8 with and without packing the group's heads into one tile, head dims
64/128/256 (and a padded 80), block sizes 16/32 (key tiles smaller and larger than a block), sliding windows
narrower and wider than a tile, softcapping, fp8 pools. The output is poisoned with NaN: every prefill row must
be written, every decode row left alone. Each runs with the new tokens' K/V read from the pool and from the step's
own k/v (`new`: what the backend does; for fp8 pools those are unquantized, and so is the reference's copy)."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops.attention.common import is_fp8
from pdserve.ops.attention.prefill import SWEEP, PrefillConfig, paged_prefill, prefill_config
from pdserve.ops.attention.torch_ref import TorchAttentionBackend
from tests.ops.attention_helpers import assert_close, gpu, make_problem, poisoned, row_kinds


def _reference(p, scale, window, softcap, new=False):
    layer = p.kv_layer if is_fp8(p.kv_layer.dtype) else p.kv_layer.float()
    kn, vn = (p.k, p.v) if new else (None, None)
    return TorchAttentionBackend().attend(p.q.float(), layer, p.meta, scale, window, softcap, p.k_scale, p.v_scale,
                                          k_new=kn, v_new=vn)


def _check(p, dtype, scale, window=None, softcap=None, config=None, new=False, kv_layer=None):
    """new: k_new/v_new are the problem's k/v (make it with write_new=True); kv_layer: the pool the kernel reads
    (default: the problem's)."""
    m = p.meta
    out = poisoned(p.q)
    kn, vn = (p.k, p.v) if new else (None, None)
    paged_prefill(p.q, p.kv_layer if kv_layer is None else kv_layer, m.block_tables, m.seq_lens_t,
                  m.query_start_loc_t, m.prefill_tiles, scale, window, softcap, p.k_scale, p.v_scale, out=out,
                  config=config, k_new=kn, v_new=vn)
    dec, pre = row_kinds(m)
    assert torch.isnan(out[dec]).all(), "decode rows were written by the prefill kernel"
    ref = _reference(p, scale, window, softcap, new)
    assert_close(out[pre], ref[pre], dtype, f"prefill window={window} softcap={softcap} config={config} new={new}")


# rows: a whole prompt, a chunk on a prefix (crossing blocks), a decode row, a short chunk, a 2-token prompt
LENS, QLENS = [37, 101, 12, 64, 2], [37, 45, 1, 9, 2]

CPU_CASES = [
    # hq, hk, d, bs, dtype, kv_dtype, window, softcap, config (block_m, block_n, g_pack)
    (2, 2, 64, 16, torch.float32, None, None, None, None),
    (8, 2, 64, 16, torch.float32, None, None, None, (32, 16, 1)),
    (8, 2, 64, 16, torch.float32, None, None, None, (32, 16, 4)),
    (8, 1, 128, 32, torch.float16, None, None, None, (64, 16, 8)),
    (8, 1, 256, 16, torch.float16, None, None, None, (32, 32, 1)),
    (4, 1, 80, 32, torch.float32, None, None, None, None),
    (8, 2, 64, 16, torch.float32, None, 5, None, None),
    (8, 2, 64, 32, torch.float16, None, 40, None, (32, 16, 2)),
    (4, 2, 64, 16, torch.float32, None, None, 3.0, None),
    (8, 2, 64, 16, torch.float32, torch.float8_e4m3fn, None, None, None),
    (4, 4, 64, 32, torch.float16, torch.float8_e5m2, 17, None, None),
    (8, 2, 64, 16, torch.float32, torch.float8_e4m3fn, 9, 3.0, (32, 16, 4)),
    (8, 2, 80, 16, torch.float16, torch.float8_e4m3fn, None, None, (32, 32, 2)),
]


@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize("hq,hk,d,bs,dtype,kv_dtype,window,softcap,config", CPU_CASES)
def test_prefill_matches_reference(hq, hk, d, bs, dtype, kv_dtype, window, softcap, config, new):
    p = make_problem(LENS, QLENS, hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype, seed=hq * d + bs,
                     write_new=new)
    cfg = PrefillConfig(*config, 4, 1) if config else None
    _check(p, dtype, d ** -0.5, window, softcap, cfg, new)


# longer rows: several key tiles from the pool, the step and the tile holding ctx in each of the window-edge,
# unmasked and diagonal ranges (ctx 0, 77, 96 = 6 x 16, 139)
LONG_LENS, LONG_QLENS = [150, 200, 1, 160, 190], [150, 123, 1, 64, 51]


@pytest.mark.parametrize("dtype,kv_dtype,window,softcap,config", [
    (torch.float32, None, None, None, (32, 16, 1)),
    (torch.float32, None, 70, None, (32, 16, 4)),
    (torch.float16, None, 45, 5.0, (64, 32, 2)),
    (torch.float32, torch.float8_e4m3fn, 70, None, (32, 16, 2)),
    (torch.float32, torch.float8_e5m2, None, 4.0, (32, 16, 1)),
])
def test_prefill_new_kv_long_rows(dtype, kv_dtype, window, softcap, config):
    p = make_problem(LONG_LENS, LONG_QLENS, hq=8, hk=2, d=32, bs=16, dtype=dtype, kv_dtype=kv_dtype, seed=11,
                     write_new=True)
    _check(p, dtype, 32 ** -0.5, window, softcap, PrefillConfig(*config, 4, 1), new=True)


@pytest.mark.parametrize("config", [(32, 16, 1), (32, 32, 4)])
def test_prefill_new_kv_never_reads_the_new_tokens_from_the_pool(config):
    """With k_new/v_new the pool's copy of every new token (even in the tile holding ctx) is left unread: NaN
    there must not reach the output."""
    p = make_problem(LONG_LENS, LONG_QLENS, hq=8, hk=2, d=32, bs=16, seed=12, write_new=True)
    layer = p.fresh_layer()
    dec, pre = row_kinds(p.meta)
    slots = torch.as_tensor(p.slots[pre])
    layer[slots // 16, :, slots % 16] = float("nan")
    _check(p, torch.float32, 32 ** -0.5, config=PrefillConfig(*config, 4, 1), new=True, kv_layer=layer)


def test_prefill_new_kv_must_match_q():
    p = make_problem(LENS, QLENS, hq=4, hk=2, d=32, bs=16, seed=1)
    m = p.meta
    args = (p.q, p.kv_layer, m.block_tables, m.seq_lens_t, m.query_start_loc_t, m.prefill_tiles, 0.2)
    with pytest.raises(ValueError, match="come together"):
        paged_prefill(*args, k_new=p.k)
    with pytest.raises(ValueError, match="k_new/v_new need"):
        paged_prefill(*args, k_new=p.k.half(), v_new=p.v.half())
    with pytest.raises(ValueError, match="k_new/v_new need"):
        paged_prefill(*args, k_new=p.k[:-1], v_new=p.v[:-1])


def test_padded_tile_entries_and_rows_are_ignored():
    p = make_problem(LENS, QLENS, hq=4, hk=2, d=32, bs=16, pad={"num_tokens": 120, "num_seqs": 8, "num_tiles": 9})
    assert p.meta.prefill_tiles.shape[0] == 9 and p.meta.prefill_tiles[4:, 0].eq(-1).all()
    _check(p, torch.float32, 0.2)


def test_default_configs_fit_the_tile_table():
    for d in (64, 128, 256):
        for g in (1, 2, 4, 6, 7, 8, 16):
            for dtype in (torch.bfloat16, torch.float32):
                cfg = prefill_config(d, g, dtype, torch.device("cuda"))
                assert g % cfg.g_pack == 0 and 128 % (cfg.block_m // cfg.g_pack) == 0


GPU_CASES = [
    # hq, hk, d, bs, dtype, kv_dtype, window: Qwen3-8B, Llama-70B (GQA 8), Gemma 3 4B/1B (d=256, windows)
    (32, 8, 128, 16, torch.bfloat16, None, None),
    (32, 8, 128, 16, torch.float16, None, None),
    (32, 8, 128, 16, torch.bfloat16, torch.float8_e4m3fn, None),
    (32, 8, 128, 32, torch.bfloat16, torch.float8_e5m2, None),
    (64, 8, 128, 16, torch.bfloat16, None, None),
    (8, 4, 256, 16, torch.bfloat16, None, 512),
    (4, 1, 256, 16, torch.bfloat16, torch.float8_e4m3fn, 512),
    (16, 16, 64, 32, torch.bfloat16, None, None),
]


@gpu
@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize("hq,hk,d,bs,dtype,kv_dtype,window", GPU_CASES)
@pytest.mark.parametrize("lens,qlens", [
    ([8192], [8192]),  # one 8k prompt
    ([8704, 1000, 2000], [512, 1, 2000]),  # a 512-token chunk on an 8k prefix, a decode row, a 2k prompt
    ([128, 1000, 4096, 77, 3000], [128, 1000, 4096, 77, 100]),  # varlen prompts and a chunk
])
def test_prefill_matches_reference_cuda(hq, hk, d, bs, dtype, kv_dtype, window, lens, qlens, new):
    p = make_problem(lens, qlens, hq=hq, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype, seed=len(lens) + d,
                     write_new=new)
    _check(p, dtype, d ** -0.5, window, new=new)


@gpu
@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize("hq,hk,d,window", [(32, 8, 128, None), (16, 8, 256, 1024)])
def test_prefill_32k_cuda(hq, hk, d, window, new):
    p = make_problem([32768], [32768], hq=hq, hk=hk, d=d, bs=16, dtype=torch.bfloat16, seed=7, write_new=new)
    _check(p, torch.bfloat16, d ** -0.5, window, new=new)


@gpu
@pytest.mark.parametrize("new", [False, True])
def test_prefill_fp32_and_softcap_cuda(new):
    p = make_problem([3000, 700], [1000, 700], hq=8, hk=2, d=128, bs=16, dtype=torch.float32, seed=4, write_new=new)
    _check(p, torch.float32, 128 ** -0.5, new=new)
    p = make_problem([3000, 700], [1000, 700], hq=8, hk=4, d=256, bs=16, dtype=torch.bfloat16, seed=4,
                     write_new=new)
    _check(p, torch.bfloat16, 256 ** -0.5, 512, 50.0, new=new)
    p = make_problem([3000, 700], [1000, 700], hq=8, hk=4, d=128, bs=16, dtype=torch.bfloat16,
                     kv_dtype=torch.float8_e4m3fn, seed=4, write_new=new)
    _check(p, torch.bfloat16, 128 ** -0.5, 512, 50.0, new=new)


@gpu
@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize("bm,bn,warps,stages", SWEEP)
@pytest.mark.parametrize("g_pack", [1, 4])
def test_benchmark_sweep_configs_are_correct_cuda(bm, bn, warps, stages, g_pack, new):
    """Every config the benchmark times (d=128) computes the right thing (1500 - 300 = 1200: ctx on no tile edge
    of 64 or 128 keys)."""
    p = make_problem([4096, 1500], [4096, 300], hq=32, hk=8, d=128, bs=16, dtype=torch.bfloat16, seed=bm + bn,
                     write_new=new)
    _check(p, torch.bfloat16, 128 ** -0.5, config=PrefillConfig(bm, bn, g_pack, warps, stages), new=new)


def test_a_measured_tile_choice_replaces_the_default_on_cuda(tmp_path, monkeypatch):
    """PDSERVE_PREFILL_CONFIG (what bench_attention.py --sweep --best-out writes) is the tile choice for bf16/fp16
    models with d <= 128 on CUDA; its g_pack is fitted to the model's group; fp32 and d=256 keep the defaults."""
    import json

    cuda = torch.device("cuda")  # prefill_config only reads the device's type
    default = prefill_config(128, 4, torch.bfloat16, cuda)
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"block_m": 128, "block_n": 128, "g_pack": 8, "num_warps": 8, "num_stages": 2,
                                "speedup_geomean_vs_default": 1.1}))
    monkeypatch.setenv("PDSERVE_PREFILL_CONFIG", str(path))
    assert prefill_config(128, 4, torch.bfloat16, cuda) == PrefillConfig(128, 128, 4, 8, 2)  # g_pack 8 > group 4
    assert prefill_config(128, 4, torch.float16, cuda) == PrefillConfig(128, 128, 4, 8, 2)
    assert prefill_config(128, 4, torch.float32, cuda) != PrefillConfig(128, 128, 4, 8, 2)
    assert prefill_config(256, 2, torch.bfloat16, cuda) != PrefillConfig(128, 128, 2, 8, 2)
    monkeypatch.delenv("PDSERVE_PREFILL_CONFIG")
    assert prefill_config(128, 4, torch.bfloat16, cuda) == default

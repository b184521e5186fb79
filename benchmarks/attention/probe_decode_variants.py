"""Where does the batch-256 decode kernel lose against a read-only pass over the same pages (s22e: 102.5 % against
105.3 % of the HBM copy rate)? Probes, over one batch-256 step's KV in the engine's head-major pool (one layer's
strided view, random pages, layers cycled so the KV is not in L2), each against the copy rate of the same run:

- `decode`: the engine's kernel (paged_decode) at several (keys per step, warps, stages) tiles, including ones
  with less shared memory a program (more programs resident on an SM);
- `prefetch_bt`: the engine's kernel with the block table read one tile ahead (the next tile's page ids loaded
  into a loop-carried value before this tile's K/V): the software pipeliner then sees the K/V loads as direct and
  keeps num_stages - 1 tiles of them in flight (s23b: the engine's loop waits for every copy at the top of each
  step, one tile buffered: 39 KB of shared memory at any num_stages);
- `persistent` (`--persistent`; s23a: slower): an experiment, not the engine's kernel: a fixed grid of programs, each walking its (row, KV head)
  items' key tiles as ONE flattened loop, so the software pipeline runs across item boundaries (a new item's first
  tiles load while the previous item finishes) instead of each program paying the block table -> KV load chain at
  its start. Uniform lengths only (every row has `--context` keys); its output is checked against the engine's.

    python benchmarks/attention/probe_decode_variants.py --out $OUT/decode_variants.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps
from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention import decode as decode_mod
from pdserve.ops.attention.decode import decode_tile, paged_decode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_kv_read import add_step_args, reporter, step_pool  # noqa: E402

ENGINE_LOOP = """    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        page = tl.load(BT + b * s_btb + n // BS, mask=valid, other=0)
        page = tl.maximum(page, 0)  # -1 entries (padded rows) never address outside the pool
"""
PREFETCH_LOOP = """    n_first = start + tl.arange(0, BLOCK_N)
    pg = tl.load(BT + b * s_btb + n_first // BS, mask=n_first < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        page = tl.maximum(pg, 0)  # -1 entries (padded rows) never address outside the pool
        nn = n + BLOCK_N
        pg = tl.load(BT + b * s_btb + nn // BS, mask=nn < end, other=0)
"""


LAUNCH = "num_warps=warps, num_stages=stages,"


def variant_module(name: str, swaps: list[tuple[str, str]]):
    """pdserve.ops.attention.decode with pieces of its text replaced, as a module of its own; its decode launch takes
    the module's MAXNREG_KW (e.g. {"maxnreg": 96}: ptxas caps the registers a thread, so more programs fit an SM)."""
    src = Path(decode_mod.__file__).read_text()
    for old, new in swaps + [(LAUNCH, LAUNCH + " **MAXNREG_KW,")]:
        if old not in src:
            return None  # the engine's kernel already changed
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"decode_{name}.py"
    path.write_text(src + "\nMAXNREG_KW = {}\n")
    spec = importlib.util.spec_from_file_location(f"decode_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@triton.jit
def _decode_persistent_kernel(Q, KV, BT, Out, s_qt, s_qh, s_ot, s_oh, s_kvb, s_kvkv, s_kvt, s_kvh, s_btb,
                              n_items, seq_len, sm_scale,
                              HK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                              BS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    mine = tl.cdiv(n_items - pid, nprog)
    total = mine * tiles
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for it in tl.range(0, total, num_stages=STAGES):
        j = it // tiles
        tile = it - j * tiles
        item = pid + j * nprog
        b = item // HK
        hk = item - b * HK
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = n < seq_len
        page = tl.load(BT + b * s_btb + n // BS, mask=valid, other=0)
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + hk * s_kvh
        k = tl.load(KV + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(KV + s_kvkv + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        h = hk * G + g
        q = tl.load(Q + b.to(tl.int64) * s_qt + h[:, None] * s_qh + d[None, :], mask=gmask[:, None], other=0.0)
        first = tile == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        s = tl.dot(q, tl.trans(k)) * (sm_scale * 1.4426950408889634)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        last = tile == tiles - 1
        out = acc / l_i[:, None]
        tl.store(Out + b.to(tl.int64) * s_ot + h[:, None] * s_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=gmask[:, None] & last)


def persistent_decode(q, lay, bt, ctx, scale, out, programs, block_n, warps, stages):
    b, hq, d = q.shape
    hk, bs = lay.shape[3], lay.shape[2]
    _decode_persistent_kernel[(programs,)](
        q, lay, bt, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        lay.stride(0), lay.stride(1), lay.stride(2), lay.stride(3), bt.stride(0), b * hk, ctx, scale,
        HK=hk, G=hq // hk, BLOCK_G=max(16, triton.next_power_of_2(hq // hk)), D=d, BS=bs, BLOCK_N=block_n,
        STAGES=stages, num_warps=warps)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap)
    ap.add_argument("--persistent", action="store_true", help="also the persistent flattened-loop kernel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    hbm = hbm_copy_gbps(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rec = new_record("decode_variants_probe", vars(args))
    rec["ceilings"] = {"hbm_copy_gbps": hbm, "gpu": torch.cuda.get_device_name(dev)}
    rec["rows"] = []
    b, ctx, hk, d = args.batch, args.context, args.hk, args.head_dim
    _, layers, bt, kv_bytes = step_pool(args, dev)
    q = torch.randn((b, args.hq, d), dtype=torch.bfloat16, device=dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    scale = d ** -0.5
    ref = paged_decode(q, layers[0], bt, sl, ctx, scale)

    report = reporter(rec, kv_bytes, hbm, 11, 60)

    print(f"{torch.cuda.get_device_name(dev)}: HBM copy {hbm:.0f} GB/s; {b} rows x {ctx} keys x {hk} KV heads: "
          f"{kv_bytes / 1e9:.2f} GB a layer; {sms} SMs", flush=True)
    eng = decode_tile(d, torch.bfloat16, False, b, b * hk, dev)
    # (name, the kernel's text swaps, tile, maxnreg): s23f timed the prefetching kernel at (64, 4, 2) 0.8 % ahead of
    # the engine's (64, 4, 3); ptxas gives them 118 and 114 registers a thread (4 programs an SM); 96 lets 5 fit
    arms = [("engine", [], eng, None), ("engine", [], eng, 96), ("engine", [], (64, 4, 2), 96),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (64, 4, 2), None),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (64, 4, 2), 104),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (64, 4, 2), 96),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (64, 4, 3), 96),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (32, 4, 2), None),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (32, 4, 3), 96),
            ("prefetch_bt", [(ENGINE_LOOP, PREFETCH_LOOP)], (64, 2, 2), None)]
    mods = {}
    for rnd in range(2):  # two rounds, in the same order: machine drift shows as a difference between them
        report("decode", graph_us([functools.partial(paged_decode, q, lay, bt, sl, ctx, scale) for lay in layers]),
               tile=eng, kernel="paged_decode as shipped", round=rnd)
        for kname, swaps, tile, mr in arms:
            key = (kname, mr)
            if key not in mods:
                mods[key] = variant_module(f"{kname}_{mr}", swaps)
                if mods[key] is not None and mr:
                    mods[key].MAXNREG_KW = {"maxnreg": mr}
            mod = mods[key]
            if mod is None:
                print(f"{kname}: the engine's kernel text changed; skipped")
                continue
            try:
                o = mod.paged_decode(q, layers[0], bt, sl, ctx, scale, tile=tile)
                err = (o.float() - ref.float()).abs().max().item()
                us = graph_us([functools.partial(mod.paged_decode, q, lay, bt, sl, ctx, scale, tile=tile)
                               for lay in layers])
            except Exception as e:  # out of resources
                print(f"{kname} {tile} {mr}: {str(e)[:160]}")
                continue
            report(kname, us, tile=tile, maxnreg=mr, round=rnd, max_err=f"{err:.3g}")
    if not args.persistent:
        if args.out:
            save_json(rec, args.out)
        return 0
    out = torch.empty_like(q)
    for per_sm, block_n, warps, stages in [(2, 64, 4, 3), (2, 64, 4, 2), (3, 64, 4, 2), (1, 64, 4, 3),
                                           (2, 32, 4, 3), (3, 32, 4, 3), (4, 32, 4, 2), (4, 32, 2, 3),
                                           (2, 64, 4, 4), (1, 64, 4, 4), (1, 64, 8, 4), (2, 64, 8, 3)]:
        progs = per_sm * sms
        try:
            persistent_decode(q, layers[0], bt, ctx, scale, out, progs, block_n, warps, stages)
            err = (out.float() - ref.float()).abs().max().item()
            us = graph_us([functools.partial(persistent_decode, q, lay, bt, ctx, scale, out, progs, block_n, warps,
                                             stages) for lay in layers])
        except Exception as e:
            print(f"persistent {per_sm} {block_n} {warps} {stages}: {str(e)[:160]}")
            continue
        report("persistent", us, per_sm=per_sm, keys=block_n, warps=warps, stages=stages, max_err=f"{err:.3g}")
    if args.out:
        save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

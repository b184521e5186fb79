"""Tile sweep of the split-K paged decode kernel (keys per step, warps, stages) for bf16 and fp8 pools, in the
engine's head-major pool layout ([blocks, kv heads, layers, 2, block size, head dim], one layer's strided view),
against the HBM copy rate measured in the same run. Prints the best tile per pool dtype over the shapes (geometric
mean of the fraction of the floor) and writes every timing as JSON.

Each timing is one CUDA graph of a call per layer of the pool (as a decode step launches them), divided by the
layers: a Python call at batch 1 costs more than the kernel (session 7's sweep timed 50-125 us per call where the
engine's graph profile showed 14 us), and cycling layers keeps the KV out of L2 the way a step does. Small batches
are also timed at other split counts (SPLITS; the engine's choice is decode.decode_splits), and with --prefetch each
tile also with the block table read a tile ahead.

  python benchmarks/attention/sweep_decode.py --out $OUT/decode_sweep.json [--hq 32 --hk 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math

import numpy as np
import torch

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps
from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention import decode as D
from pdserve.ops.attention.common import as_storage, is_fp8
from pdserve.ops.attention.decode import decode_tile, paged_decode

SHAPES = [(1, 1024), (1, 8192), (1, 32768), (4, 8192), (32, 4096), (128, 2048), (256, 1024), (256, 4096)]
TILES = [(32, 4, 2)] + [(n, w, s) for n, w, s in itertools.product((64, 128, 256), (4, 8), (2, 3, 4))]
SPLITS = (0, 16, 64, 128)  # 0: the engine's (decode_splits); others for batches below SPLIT_ROWS
SPLIT_ROWS = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12, help="layers in the pool, one call per layer in each timing")
    ap.add_argument("--shapes", default="", help="rowsxcontext,... (default: SHAPES)")
    ap.add_argument("--splits", default="", help="split counts for small batches, 0 the engine's (default: SPLITS)")
    ap.add_argument("--kv", default="bf16,fp8", help="pool dtypes: bf16, fp8")
    ap.add_argument("--prefetch", action="store_true",
                    help="also time each tile with the block table read a tile ahead (the kernel's PREFETCH_BT)")
    ap.add_argument("--tiles", default="", help="keys,warps,stages;... (default: TILES)")
    ap.add_argument("--v-widen", action="store_true",
                    help="also time each fp8 tile with V widened by inline PTX (decode.FP8_V_WIDEN)")
    ap.add_argument("--maxnreg", default="0",
                    help="registers a thread of an fp8 launch may hold, comma-separated (decode.FP8_MAXNREG; 0: as "
                         "the compiler likes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    splits = tuple(int(x) for x in args.splits.split(",")) if args.splits else SPLITS
    prefetches = (False, True) if args.prefetch else (False,)
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";")] if args.tiles else TILES
    shipped_widen = (D.FP8_V_WIDEN_FEW, D.FP8_V_WIDEN)  # by many-program launch, before the sweep sets them
    widens = (False, True) if args.v_widen else (False,)
    maxnregs = tuple(int(x) for x in args.maxnreg.split(","))
    dev = torch.device("cuda")
    hbm = hbm_copy_gbps(dev)
    rec = new_record("decode_tile_sweep", vars(args))
    rec["ceilings"] = {"hbm_copy_gbps": hbm, "gpu": torch.cuda.get_device_name(dev)}
    rec["rows"], rec["best"] = [], {}
    max_tokens = max(b * c for b, c in shapes)
    nb = max_tokens // args.block_size + 64
    rng = np.random.default_rng(0)
    for name, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        if name not in args.kv.split(","):
            continue
        pool = torch.empty((nb, args.hk, args.layers, 2, args.block_size, args.head_dim), dtype=dt, device=dev)
        if is_fp8(dt):
            as_storage(pool).random_(0, 256).bitwise_and_(0x77)
        else:
            pool.normal_()
        layers = [pool[:, :, i].permute(0, 2, 3, 1, 4) for i in range(args.layers)]  # [blocks, 2, bs, hk, d]
        scale = torch.tensor(1.0, device=dev) if is_fp8(dt) else None
        default = decode_tile(args.head_dim, torch.bfloat16, is_fp8(dt), 8)  # the many-row tile
        scores: dict[tuple, list[float]] = {t: [] for t in tiles}
        for b, ctx in shapes:
            width = -(-ctx // args.block_size)
            perm = rng.permutation(nb)[: b * width] if b * width <= nb else rng.integers(0, nb, b * width)
            bt = torch.tensor(perm.reshape(b, width).astype(np.int32), device=dev)
            sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn((b, args.hq, args.head_dim), dtype=torch.bfloat16, device=dev)
            kv_bytes = b * ctx * args.hk * args.head_dim * 2 * pool.element_size()
            floor = kv_bytes / (hbm * 1e9) * 1e6
            # what paged_decode takes at this shape as shipped (one split from SPLIT_ROWS rows, as timed here)
            n_prog = b * args.hk * (1 if b >= SPLIT_ROWS else D.decode_splits(b, args.hk, ctx, None, dev))
            many = D.many_programs(torch.bfloat16, is_fp8(dt), n_prog, dev)
            engine_tile = decode_tile(args.head_dim, torch.bfloat16, is_fp8(dt), b, n_prog, dev)
            engine_pf = many and D.MANY_PROGRAMS_PREFETCH
            engine_vw = is_fp8(dt) and shipped_widen[many]
            ref = paged_decode(q, layers[0], bt, sl, ctx, args.head_dim ** -0.5, k_scale=scale, v_scale=scale)
            for t, pf, vw, mr in itertools.product(tiles, prefetches, widens, maxnregs):
                if (vw or mr) and not is_fp8(dt):
                    continue
                D.FP8_V_WIDEN = D.FP8_V_WIDEN_FEW = vw  # read by paged_decode at each call (and capture)
                D.FP8_MAXNREG = mr
                plain = not pf and not vw and not mr
                for sp in (splits if b < SPLIT_ROWS else (0,)):
                    kw = dict(k_scale=scale, v_scale=scale, tile=t, num_splits=sp or None, prefetch=pf)
                    try:
                        out = paged_decode(q, layers[0], bt, sl, ctx, args.head_dim ** -0.5, **kw)
                        if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                            raise RuntimeError("output differs from the default tile's")
                        us = graph_us([functools.partial(paged_decode, q, lay, bt, sl, ctx, args.head_dim ** -0.5,
                                                         **kw) for lay in layers])
                    except Exception as e:  # out of resources, compile failure
                        rec["rows"].append({"kv": name, "batch": b, "context": ctx, "tile": t, "splits": sp,
                                            "prefetch": pf, "v_widen": vw, "maxnreg": mr,
                                            "error": str(e)[:200]})
                        if not sp and plain:
                            scores[t].append(1e-3)
                        continue
                    if not sp and plain:
                        scores[t].append(floor / us)
                    rec["rows"].append({"kv": name, "batch": b, "context": ctx, "tile": t, "splits": sp,
                                        "prefetch": pf, "v_widen": vw, "maxnreg": mr, "us": us,
                                        "floor_us": floor,
                                        "of_floor": floor / us, "default": t == default,
                                        "engine": t == engine_tile and not sp and pf == engine_pf
                                        and vw == engine_vw and not mr})
                D.FP8_V_WIDEN = D.FP8_V_WIDEN_FEW = False
                D.FP8_MAXNREG = 0
            mine = [r for r in rec["rows"] if r.get("us") and r["kv"] == name and r["batch"] == b
                    and r["context"] == ctx]
            best = min(mine, key=lambda r: r["us"])
            eng = next((r for r in mine if r["engine"]), None)
            for r in sorted(mine, key=lambda r: r["us"])[:6]:
                print(f"    {r['tile']} splits {r['splits'] or 'engine'} prefetch {r['prefetch']} "
                      f"v_widen {r['v_widen']} maxnreg {r['maxnreg']}: {r['us']:.2f} us", flush=True)
            if args.out:
                save_json(rec, args.out)  # each shape as it ends (a call cut short keeps what it timed)
            print(f"{name} b={b} ctx={ctx}: best {best['tile']} splits {best['splits'] or 'engine'} "
                  f"{best['us']:.1f} us ({100 * best['of_floor']:.0f}% of floor)"
                  + (f"; the engine's {eng['tile']} {eng['us']:.1f} us ({100 * eng['of_floor']:.0f}%)" if eng else ""),
                  flush=True)
        ranked = sorted(tiles, key=lambda t: -math.prod(scores[t]) ** (1 / len(scores[t])))
        for t in ranked[:5] + ([default] if default in scores else []):
            gm = math.prod(scores[t]) ** (1 / len(scores[t]))
            print(f"{name} tile {t}: geo-mean {100 * gm:5.1f}% of floor; per shape "
                  + " ".join(f"{100 * s:4.0f}%" for s in scores[t]) + ("  (default)" if t == default else ""),
                  flush=True)
        rec["best"][name] = {"tile": ranked[0], "per_shape": scores[ranked[0]],
                             "default": default, "default_per_shape": scores.get(default)}
        del pool, layers, ref  # before the next dtype's pool
    if args.out:
        save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast can a batch-256 decode step's KV be read from the engine's pool? The decode kernel reads each (row, KV
head)'s pages at about the HBM copy rate; a read-only stream can beat a copy (no write turnarounds: the one-row
LM-head product read its weight at ~107 % of the copy rate, docs/benchmarks.md). This probe times, over the same
bytes in the engine's head-major pool layout (one layer's strided view, random pages, layers cycled so the KV is
not in L2):

- `paged`: a kernel that only reads the K and V pages of every (row, KV head) through the block table, as the
  decode kernel walks them, and sums them (keys per step, warps, pipeline stages, and a cache policy varied);
- `flat`: the same number of bytes read as one contiguous stream;
- `decode`: the engine's decode kernel on that step (paged_decode, its own tile choice);

each against the HBM copy rate measured in the same run. `--layers 36` gives the blocks dummy Qwen3-8B's pool has
(2.25 MiB: every layer of a block's 8 heads), `--pages seq` each row's pages one after the other (a fresh pool), and
`--quick` also times the paged read with the KV heads first in the grid: a row's 8 heads, which share each block,
side by side. Session 33 (benchmarks/lease_s33/s33a) found neither the block size nor the order moved either kernel
by more than 1 %, so the decode kernel kept its order (rows first).

    python benchmarks/attention/probe_kv_read.py --out $OUT/kv_read.json
"""

from __future__ import annotations

import argparse
import functools
import itertools

import numpy as np
import torch
import triton
import triton.language as tl

from pdserve.bench.ceilings import graph_us, hbm_copy_gbps
from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention.decode import decode_tile, paged_decode


@triton.jit
def _paged_read_kernel(KV, BT, Out, s_kvb, s_kvkv, s_kvt, s_kvh, s_btb, seq_len,
                       D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                       EVICT: tl.constexpr, HEAD_FIRST: tl.constexpr = False):
    if HEAD_FIRST:  # grid (KV heads, rows): a row's heads side by side, as decode.HEAD_FIRST
        b = tl.program_id(1)
        hk = tl.program_id(0)
        num_hk = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        hk = tl.program_id(1)
        num_hk = tl.num_programs(1)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for n0 in tl.range(0, seq_len, BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < seq_len
        page = tl.load(BT + b * s_btb + n // BS, mask=valid, other=0)
        base = page.to(tl.int64) * s_kvb + (n % BS) * s_kvt + hk * s_kvh
        k = tl.load(KV + base[:, None] + d[None, :], mask=valid[:, None], other=0.0, eviction_policy=EVICT)
        v = tl.load(KV + s_kvkv + base[:, None] + d[None, :], mask=valid[:, None], other=0.0, eviction_policy=EVICT)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + (b * num_hk + hk) * D + d, tl.sum(acc, 0))


@triton.jit
def _flat_read_kernel(X, Out, n_per_prog, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = X + p * n_per_prog
    for i in tl.range(0, n_per_prog, BLOCK, num_stages=STAGES):
        acc += tl.load(base + i + offs).to(tl.float32)
    tl.store(Out + p, tl.sum(acc, 0))


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The batch-256 decode step's shape (dummy Qwen3-8B) the KV probes share."""
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1088)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--pages", choices=("random", "seq"), default="random",
                    help="the block table: random pages, or each row's pages one after the other (a fresh pool)")


def step_pool(args, dev: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, int]:
    """(pool, per-layer views [blocks, 2, bs, hk, d], block table of random pages, one layer's KV bytes) in the
    engine's head-major layout [blocks, hk, layers, 2, bs, d]."""
    b, ctx, hk, d, bs, nl = args.batch, args.context, args.hk, args.head_dim, args.block_size, args.layers
    width = -(-ctx // bs)
    nb = b * width + 64
    pool = torch.randn((nb, hk, nl, 2, bs, d), dtype=torch.bfloat16, device=dev)
    layers = [pool[:, :, i].permute(0, 2, 3, 1, 4) for i in range(nl)]
    rng = np.random.default_rng(0)
    ids = rng.permutation(nb) if getattr(args, "pages", "random") == "random" else np.arange(nb)
    bt = torch.tensor(ids[: b * width].reshape(b, width).astype(np.int32), device=dev)
    return pool, layers, bt, b * ctx * hk * d * 2 * 2


def reporter(rec: dict, kv_bytes: int, hbm: float, name_width: int, kw_width: int):
    """report(name, us, **settings): one timing of a layer's KV read into rec["rows"] and printed, against the
    HBM copy rate of the same run."""
    def report(name: str, us: float, **kw) -> None:
        gbps = kv_bytes / (us * 1e-6) / 1e9
        rec["rows"].append({"probe": name, "us": us, "gbps": gbps, "of_copy": gbps / hbm, **kw})
        settings = " ".join(f"{k}={v}" for k, v in kw.items())
        print(f"{name:{name_width}s} {settings:{kw_width}s} {us:8.1f} us  {gbps:7.0f} GB/s  "
              f"{100 * gbps / hbm:5.1f} % of the copy rate", flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="only the paged read's best settings of session 22 (64 keys, 4 warps, 2 and 3 stages) in both grid "
                         "orders (rows first, as the decode kernel; KV heads first), no flat stream, the decode kernel "
                         "at the engine's tile")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    hbm = hbm_copy_gbps(dev)
    rec = new_record("kv_read_probe", vars(args))
    rec["ceilings"] = {"hbm_copy_gbps": hbm, "gpu": torch.cuda.get_device_name(dev)}
    rec["rows"] = []
    b, ctx, hk, d, bs, nl = args.batch, args.context, args.hk, args.head_dim, args.block_size, args.layers
    pool, layers, bt, kv_bytes = step_pool(args, dev)
    out = torch.empty((b * hk * d,), dtype=torch.float32, device=dev)

    report = reporter(rec, kv_bytes, hbm, 8, 45)

    print(f"{torch.cuda.get_device_name(dev)}: HBM copy {hbm:.0f} GB/s; {b} rows x {ctx} keys x {hk} KV heads: "
          f"{kv_bytes / 1e9:.2f} GB a layer; {nl} layers, a block {pool[0].numel() * pool.element_size() / 2**20:.2f} "
          f"MiB; {args.pages} pages", flush=True)
    if args.quick:
        settings = list(itertools.product((64,), (4,), (2, 3), ("",), (False, True)))
    else:
        settings = list(itertools.product((16, 32, 64, 128), (4, 8), (2, 3, 4), ("", "evict_first"), (False,)))
    for block_n, warps, stages, evict, head_first in settings:
        def run(lay, block_n=block_n, warps=warps, stages=stages, evict=evict, head_first=head_first):
            _paged_read_kernel[(hk, b) if head_first else (b, hk)](
                lay, bt, out, lay.stride(0), lay.stride(1), lay.stride(2), lay.stride(3), bt.stride(0), ctx, D=d,
                BS=bs, BLOCK_N=block_n, STAGES=stages, EVICT=evict, HEAD_FIRST=head_first, num_warps=warps)
        try:
            us = graph_us([functools.partial(run, lay) for lay in layers])
        except Exception as e:  # out of resources
            print(f"paged {block_n} {warps} {stages} {evict}: {str(e)[:120]}")
            continue
        report("paged", us, keys=block_n, warps=warps, stages=stages, evict=evict or "default",
               order="head" if head_first else "row")
    flat = pool.view(-1)
    per_layer = kv_bytes // 2  # elements of one layer's share
    progs = b * hk
    n_per = per_layer // progs
    for block, stages, warps in [] if args.quick else itertools.product((1024, 4096), (2, 4), (4, 8)):
        views = [flat[i * per_layer:(i + 1) * per_layer] for i in range(min(nl, flat.numel() // per_layer))]
        us = graph_us([functools.partial(_flat_read_kernel[(progs,)], v, out, n_per, BLOCK=block, STAGES=stages,
                                         num_warps=warps) for v in views])
        report("flat", us, block=block, stages=stages, warps=warps)
    q = torch.randn((b, args.hq, d), dtype=torch.bfloat16, device=dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    eng = decode_tile(d, torch.bfloat16, False, b, b * hk, dev)
    tiles = [eng] if args.quick else sorted({eng, (64, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 4), (32, 4, 4)})
    for tile in tiles:
        # tile=None: the engine's own choice (its tile and the page ids read a tile ahead)
        us = graph_us([functools.partial(paged_decode, q, lay, bt, sl, ctx, d ** -0.5,
                                         tile=None if tile == eng else tile) for lay in layers])
        report("decode", us, tile=tile, engine=tile == eng)
    if args.out:
        save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

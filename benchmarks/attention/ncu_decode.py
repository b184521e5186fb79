"""The batch-256 decode kernel and the read-only pass over the same pages (probe_kv_read.py's `paged`), each launched
a few times on one step's KV (random pages of the engine's head-major pool), for Nsight Compute to read their
counters side by side; and each compiled kernel's registers, spills and shared memory as Triton reports them.

    ncu --clock-control none -k regex:"_decode_kernel|_paged_read_kernel" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats python3 benchmarks/attention/ncu_decode.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_kv_read import _paged_read_kernel, add_step_args, step_pool  # noqa: E402

from pdserve.ops.attention.decode import _decode_kernel, decode_tile, paged_decode  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    b, ctx, hq, hk, d, bs = args.batch, args.context, args.hq, args.hk, args.head_dim, args.block_size
    _, layers, bt, _ = step_pool(args, dev)
    lay = layers[0]
    q = torch.randn((b, hq, d), dtype=torch.bfloat16, device=dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    out = torch.empty((b * hk * d,), dtype=torch.float32, device=dev)
    tile = decode_tile(d, torch.bfloat16, False, b, b * hk, dev)
    for _ in range(args.launches):
        paged_decode(q, lay, bt, sl, ctx, d ** -0.5)
    for _ in range(args.launches):
        _paged_read_kernel[(b, hk)](lay, bt, out, lay.stride(0), lay.stride(1), lay.stride(2), lay.stride(3),
                                    bt.stride(0), ctx, D=d, BS=bs, BLOCK_N=64, STAGES=3, EVICT="", num_warps=4)
    torch.cuda.synchronize()
    print(f"engine tile {tile}")
    for name, kern in (("decode", _decode_kernel), ("paged_read", _paged_read_kernel)):
        for dev_cache in kern.device_caches.values():
            for k in dev_cache[0].values():
                md = k.metadata
                print(f"{name}: regs {k.n_regs} spills {k.n_spills} shared {md.shared} warps {md.num_warps} "
                      f"stages {md.num_stages}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

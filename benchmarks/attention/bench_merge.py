"""The long-prefill row's merge (pdserve.ops.attention.merge) on the inputs the row gives it, and variants of its
launch: the 32k prompt's 8k chunks of dummy Qwen3-8B (Hq x D = 32 x 128 over 8 KV heads, bf16).

The merge reads both calls' outputs and writes the row's: three [q_len, 32, 128] bf16 tensors, a memory-bound
kernel. Each case runs library_prefill.attend_row once with merge.merge_two captured, so the arms see the very views
(strides, offsets) the engine's merge gets. Arms, named `<align>:<block_t>:<num_warps>`:
  align   `free`: the kernel as built until session 43 (no pointer's alignment specialized: Triton cannot prove 16-byte
          alignment, so it loads and stores two bytes at a time); `o`: the outputs' pointers (O1, O2, Out) specialized,
          the log-sum-exps' not (their slices start anywhere, so one binary still serves every chunk)
  block_t rows a program; num_warps its warps
For each arm and case, triton.testing.do_bench's median (us), the bytes moved at that time (GB/s, and the fraction
of the HBM copy rate measured in the same run), and the output against merge_two_reference (max abs difference)
and against the `free:32:4` arm (bitwise).

    python benchmarks/attention/bench_merge.py --out $OUT/merge.json

--run-with ARM -- SCRIPT ARGS...: run SCRIPT (e.g. benchmarks/engine/bench_steps.py) with the engine's merge built
and launched as ARM, for an A/B of whole steps in one lease.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch
import triton

from pdserve.bench.ceilings import hbm_copy_gbps
from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention import library_prefill as lib
from pdserve.ops.attention import merge as M

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_library_row import HQ, D, row_inputs, us  # noqa: E402

ALIGN = {  # pointers whose alignment Triton may not assume
    "free": ["O1", "L1", "O2", "L2", "Out"],
    "o": ["L1", "L2"],
}


def kernel(align: str):
    """_merge_two_kernel's code built with the given alignment rule (one binary for any L, as shipped)."""
    return triton.jit(M._merge_two_kernel.fn, do_not_specialize=["L"], do_not_specialize_on_alignment=ALIGN[align])


def parse_arm(arm: str) -> tuple[str, int, int]:
    align, bt, nw = arm.split(":")
    if align not in ALIGN:
        raise SystemExit(f"unknown alignment {align!r}: {sorted(ALIGN)}")
    return align, int(bt), int(nw)


def merge_inputs(ctx: int, t: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(o1, l1, o2, l2, out) exactly as library_prefill.attend_row hands them to merge_two for a row of ctx cached and
    t new tokens (random values; the two cuDNN calls run for real)."""
    _, kv_layer, table, qr, kr, vr = row_inputs(ctx, t, dev)
    kp, vp = lib.gather_prefix(kv_layer, table, ctx)
    out = torch.empty((t, HQ, D), dtype=torch.bfloat16, device=dev)
    got = {}
    orig = M.merge_two
    M.merge_two = lambda o1, l1, o2, l2, o: got.update(args=(o1, l1, o2, l2, o))
    try:
        lib.attend_row(qr, kr, vr, kp, vp, D ** -0.5, out)
    finally:
        M.merge_two = orig
    if "args" not in got:
        raise SystemExit(f"ctx {ctx} + {t}: the row made no merge (a prefix under one bucket?)")
    return got["args"]


def time_case(ctx: int, t: int, kernels: dict, arms: list[tuple[str, int, int]], copy_gbps: float) -> dict:
    """Every arm on one row's merge inputs."""
    o1, l1, o2, l2, out = merge_inputs(ctx, t, torch.device("cuda"))
    ref = M.merge_two_reference(o1, l1, o2, l2)
    M.launch(kernels["free"], o1, l1, o2, l2, out, 32, 4)
    base = out.clone()
    nbytes = 3 * o1.numel() * o1.element_size() + 2 * l1.numel() * 4
    res = {"ctx": ctx, "new": t, "bytes": nbytes, "o1_stride": list(o1.stride()), "out_stride": list(out.stride()),
           "l1_stride": list(l1.stride()), "l2_offset_bytes_mod16": l2.data_ptr() % 16, "arms": []}
    for a, bt, nw in arms:
        def go(a=a, bt=bt, nw=nw):
            M.launch(kernels[a], o1, l1, o2, l2, out, bt, nw)
        go()
        torch.cuda.synchronize()
        got = out.clone()
        t_us = us(go)
        gbps = nbytes / (t_us * 1e-6) / 1e9
        r = {"arm": f"{a}:{bt}:{nw}", "us": t_us, "GBps": gbps, "of_copy": gbps / copy_gbps,
             "max_abs_diff_ref": (got.float() - ref.float()).abs().max().item(),
             "equal_free_32_4": bool(torch.equal(got, base))}
        res["arms"].append(r)
        print(f"ctx {ctx} + {t}  {r['arm']:10s} {t_us:8.1f} us  {gbps:7.0f} GB/s ({r['of_copy']:.0%} of copy)  "
              f"diff {r['max_abs_diff_ref']:.1e}  equal {r['equal_free_32_4']}", flush=True)
    return res


def run(args) -> dict:
    rec = new_record("bench_merge", dict(vars(args)))
    rec["hbm_copy_GBps"] = hbm_copy_gbps()
    kernels = {a: kernel(a) for a in ALIGN}
    arms = [(a, bt, nw) for a in ALIGN for bt in args.block_t for nw in args.warps]
    rec["cases"] = []
    for case in args.cases.split(","):
        ctx, t = (int(x) for x in case.split(":"))
        rec["cases"].append(time_case(ctx, t, kernels, arms, rec["hbm_copy_GBps"]))
        torch.cuda.empty_cache()
    # the arm with the least time over all cases
    total: dict[str, float] = {}
    for c in rec["cases"]:
        for r in c["arms"]:
            total[r["arm"]] = total.get(r["arm"], 0.0) + r["us"]
    rec["total_us"] = total
    rec["best"] = min(total, key=total.get)
    print(f"hbm copy {rec['hbm_copy_GBps']:.0f} GB/s; best over the cases: {rec['best']} "
          f"({total[rec['best']]:.1f} us against free:32:4's {total.get('free:32:4', float('nan')):.1f})")
    return rec


def run_with(arm: str, argv: list[str]) -> None:
    """Run argv[0] as __main__ with the engine's merge built and launched as `arm`."""
    align, bt, nw = parse_arm(arm)
    M._merge_two_kernel = kernel(align)
    M.BLOCK_T, M.NUM_WARPS = bt, nw
    print(f"merge arm {arm}", flush=True)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    if "--run-with" in sys.argv:
        i = sys.argv.index("--run-with")
        rest = sys.argv[i + 2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        run_with(sys.argv[i + 1], rest)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="8192:8192,16384:8192,24576:8192,4096:2048,9002:1000",
                   help="prefix:new tokens of each row")
    p.add_argument("--block-t", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    p.add_argument("--warps", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rec = run(args)
    if args.out:
        save_json(rec, args.out)


if __name__ == "__main__":
    main()

"""Attention kernels on one GPU against ceilings measured in the same run.

decode: the split-K paged decode kernel for batch x context (all rows the same length, shuffled block tables);
        floor = KV bytes read / measured HBM copy rate (bytes read + written per second of a large copy).
prefill: the varlen paged prefill kernel for one prompt of each length, several 1k prompts in one launch, and a
        512-token chunk on an 8k prefix, reading the new tokens' K/V from the step's k/v as the backend's forward
        has it do (the prefix from the pool); floor = causal FLOPs (4 * Hq * D * visible query-key pairs) / measured
        bf16 matmul rate; torch SDPA (flash, contiguous K/V, causal) on the same whole-prompt shapes as a sanity
        ceiling. Both for a bf16 and an fp8 (e4m3) KV pool. `--sweep` also times prefill tile configs.
A mixed step (decode rows and a prefill chunk in one forward) is timed too. Times are medians of
triton.testing.do_bench (which clears L2 between runs). Kernel times only: no model, no CUDA graph.

  python benchmarks/attention/bench_attention.py --out $OUT/attention.json [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch
import triton
import triton.testing

from pdserve.bench.ceilings import hbm_copy_gbps, matmul_tflops
from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention import AttentionMetadataBuilder
from pdserve.ops.attention.common import as_storage, is_fp8
from pdserve.ops.attention.kv_write import write_kv
from pdserve.ops.attention.prefill import SWEEP, PrefillConfig, default_g_pack, prefill_config
from pdserve.ops.attention.triton_backend import TritonAttentionBackend

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp16": torch.float16}


def bench_us(fn) -> float:
    if not torch.cuda.is_available():  # --cpu-smoke: one timed call in Triton's interpreter
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def time_attend(backend, q, pool, meta, args, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> float:
    """The backend's attention after its KV write, as forward runs it: prefill rows read their new tokens' K/V from
    k/v ([T, Hk, D], q's rows; the pool's copy is random here, which costs the same)."""
    if not args.new_kv:
        k = v = None
    return bench_us(lambda: backend.attend(q, pool.layer, meta, args.head_dim ** -0.5, args.window, None, pool.scale,
                                           pool.scale, k_new=k, v_new=v))


def new_kv(t: int, args, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K and V of t new tokens, as views of one fused QKV projection output (the engine's strides)."""
    hq, hk, d = args.hq, args.hk, args.head_dim
    qkv = torch.randn((t, (hq + 2 * hk) * d), dtype=torch.bfloat16, device=dev)
    return qkv[:, hq * d: (hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d:].view(t, hk, d)


def time_write(k, pool, meta) -> float:
    return bench_us(lambda: write_kv(pool.layer, k, k, meta.slot_mapping, pool.scale, pool.scale))


class Pool:
    """One layer's random pool with a shuffled block order; hands out block tables for given lengths."""

    def __init__(self, tokens: int, hk: int, d: int, bs: int, kv_dtype: torch.dtype, dev: torch.device):
        self.bs = bs
        self.nb = tokens // bs + 64
        self.pool = torch.empty((self.nb, 1, 2, bs, hk, d), dtype=kv_dtype, device=dev)
        if is_fp8(kv_dtype):  # random bytes without the NaN/inf exponent patterns
            as_storage(self.pool).random_(0, 256).bitwise_and_(0x77)
        else:
            self.pool.normal_()
        self.layer = self.pool[:, 0]
        self.perm = np.random.default_rng(0).permutation(self.nb).astype(np.int32)
        self.scale = torch.tensor(1.0, device=dev) if is_fp8(kv_dtype) else None

    def tables(self, lens: list[int]) -> list[np.ndarray]:
        out, used = [], 0
        for n in lens:
            k = -(-n // self.bs)
            if used + k > self.nb:
                used = 0
            out.append(self.perm[used: used + k])
            used += k
        return out


def step_meta(builder, pool: Pool, lens: list[int], qlens: list[int]):
    tables = pool.tables(lens)
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, qlens)])
    row = np.repeat(np.arange(len(lens)), qlens)
    width = max(len(t) for t in tables)
    tab = np.full((len(lens), width), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        tab[i, : len(t)] = t
    slots = tab[row, pos // pool.bs].astype(np.int64) * pool.bs + pos % pool.bs
    return builder.build(qsl, lens, tab, slots)


def causal_flops(hq: int, d: int, lens: list[int], qlens: list[int], window: int | None) -> float:
    pairs = 0
    for n, q in zip(lens, qlens):
        p = np.arange(n - q, n, dtype=np.float64)
        vis = p + 1 if window is None else np.minimum(p + 1, window)
        pairs += vis.sum()
    return 4.0 * hq * d * pairs


def sdpa_us(hq: int, hk: int, d: int, n: int, dtype, dev) -> float | None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn((1, hq, n, d), dtype=dtype, device=dev)
    k = torch.randn((1, hk, n, d), dtype=dtype, device=dev)
    v = torch.randn((1, hk, n, d), dtype=dtype, device=dev)
    if hq != hk:
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return bench_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    except RuntimeError as e:
        print(f"  sdpa flash unavailable: {e}", file=sys.stderr)
        return None


def run_decode(args, pool: Pool, builder, kv_name: str, hbm: float, dev) -> list[dict]:
    backend = TritonAttentionBackend()
    rows = []
    for b in args.decode_batches:
        for ctx in args.decode_contexts:
            if b * ctx > args.max_decode_tokens:
                continue
            meta = step_meta(builder, pool, [ctx] * b, [1] * b)
            q = torch.randn((b, args.hq, args.head_dim), dtype=torch.bfloat16, device=dev)
            us = time_attend(backend, q, pool, meta, args)
            span = min(ctx, args.window) if args.window else ctx
            kv_bytes = b * span * args.hk * args.head_dim * 2 * pool.pool.element_size()
            floor = kv_bytes / (hbm * 1e9) * 1e6
            rows.append({"kv": kv_name, "batch": b, "context": ctx, "us": us, "floor_us": floor,
                         "of_floor": floor / us, "gbps": kv_bytes / us / 1e3})
            print(f"decode {kv_name:4} B={b:4} ctx={ctx:6}  {us:9.1f} us  floor {floor:8.1f} us  "
                  f"{100 * floor / us:5.1f}%  {kv_bytes / us / 1e3:7.0f} GB/s", flush=True)
    return rows


def prefill_shapes(args) -> list[tuple[str, list[int], list[int]]]:
    shapes = [(f"prompt {n}", [n], [n]) for n in args.prefill_lens]
    m, n = args.multi
    shapes.append((f"{m} x {n}", [n] * m, [n] * m))
    shapes.append((f"chunk {args.chunk} on {args.prefix}", [args.prefix + args.chunk], [args.chunk]))
    return shapes


def run_prefill(args, pool: Pool, builder, kv_name: str, tflops: float, dev, with_sdpa: bool) -> list[dict]:
    backend = TritonAttentionBackend()
    rows = []
    for name, lens, qlens in prefill_shapes(args):
        meta = step_meta(builder, pool, lens, qlens)
        t = sum(qlens)
        q = torch.randn((t, args.hq, args.head_dim), dtype=torch.bfloat16, device=dev)
        k, v = new_kv(t, args, dev)
        us = time_attend(backend, q, pool, meta, args, k, v)
        w_us = time_write(k, pool, meta)
        flops = causal_flops(args.hq, args.head_dim, lens, qlens, args.window)
        row = {"kv": kv_name, "shape": name, "lens": lens, "new_tokens": qlens, "us": us, "write_us": w_us,
               "tflops": flops / us / 1e6, "floor_us": flops / (tflops * 1e12) * 1e6}
        row["of_floor"] = row["floor_us"] / us
        line = (f"prefill {kv_name:4} {name:18} {us:10.1f} us  {row['tflops']:6.1f} TFLOP/s "
                f"({100 * row['of_floor']:4.1f}% of matmul)  write {w_us:7.1f} us")
        if with_sdpa and len(lens) == 1 and lens == qlens and not args.window:
            s = sdpa_us(args.hq, args.hk, args.head_dim, lens[0], torch.bfloat16, dev)
            if s is not None:
                row["sdpa_flash_us"] = s
                row["sdpa_tflops"] = flops / s / 1e6
                line += f"  | sdpa flash {s:9.1f} us {row['sdpa_tflops']:6.1f} TFLOP/s"
        print(line, flush=True)
        rows.append(row)
    return rows


def run_mixed(args, pool: Pool, builder, kv_name: str, dev) -> dict:
    backend = TritonAttentionBackend()
    backend.read_new_kv = args.new_kv
    nd, ctx = args.mixed_decodes
    lens, qlens = [ctx] * nd + [args.prefix + args.chunk], [1] * nd + [args.chunk]
    meta = step_meta(builder, pool, lens, qlens)
    t = sum(qlens)
    q = torch.randn((t, args.hq, args.head_dim), dtype=torch.bfloat16, device=dev)
    k, v = new_kv(t, args, dev)
    us = bench_us(lambda: backend.forward(q, k, v, pool.layer, meta, args.head_dim ** -0.5, args.window, None,
                                          pool.scale, pool.scale))
    what = f"{nd} decodes at {ctx} + chunk {args.chunk} on {args.prefix}"
    print(f"mixed   {kv_name:4} {what}: forward {us:.1f} us", flush=True)
    return {"kv": kv_name, "step": what, "forward_us": us}


def run_sweep(args, pool: Pool, builder, kv_name: str, tflops: float, dev) -> list[dict]:
    rows = []
    g = args.hq // args.hk
    shapes = [(f"prompt {n}", [n], [n]) for n in args.sweep_lens]
    shapes.append((f"chunk {args.chunk} on {args.prefix}", [args.prefix + args.chunk], [args.chunk]))
    default = prefill_config(args.head_dim, g, torch.bfloat16, dev)
    for name, lens, qlens in shapes:
        meta = step_meta(builder, pool, lens, qlens)
        q = torch.randn((sum(qlens), args.hq, args.head_dim), dtype=torch.bfloat16, device=dev)
        k, v = new_kv(sum(qlens), args, dev)
        flops = causal_flops(args.hq, args.head_dim, lens, qlens, args.window)
        for bm, bn, warps, stages in SWEEP:
            for pack in sorted({1, default_g_pack(g, bm)}):
                cfg = PrefillConfig(bm, bn, pack, warps, stages)
                backend = TritonAttentionBackend(cfg)
                try:
                    us = time_attend(backend, q, pool, meta, args, k, v)
                except Exception as e:  # out of shared memory or registers: recorded, not fatal
                    print(f"sweep {kv_name} {name} {cfg}: failed: {type(e).__name__}: {e}"[:300], flush=True)
                    rows.append({"kv": kv_name, "shape": name, "config": cfg.__dict__, "error": str(e)[:300]})
                    continue
                mark = " (default)" if cfg == default else ""
                print(f"sweep {kv_name:4} {name:18} bm={bm:3} bn={bn:3} pack={pack} w={warps} s={stages}: "
                      f"{us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s{mark}", flush=True)
                rows.append({"kv": kv_name, "shape": name, "config": cfg.__dict__, "us": us,
                             "tflops": flops / us / 1e6, "default": cfg == default})
    return rows


def best_of_sweep(rows: list[dict]) -> dict | None:
    """The config with the highest geometric mean, over the swept shapes, of its speed against the default's (one
    that failed or missed a shape is out); None if the default was not timed on every shape."""
    shapes = sorted({r["shape"] for r in rows})
    base = {r["shape"]: r["us"] for r in rows if r.get("default") and "us" in r}
    if set(base) != set(shapes):
        return None
    by_cfg: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if "us" in r:
            by_cfg.setdefault(tuple(sorted(r["config"].items())), {})[r["shape"]] = r["us"]
    scored = []
    for key, times in by_cfg.items():
        if set(times) == set(shapes):
            gain = math.prod(base[sh] / times[sh] for sh in shapes) ** (1 / len(shapes))
            scored.append((gain, key, times))
    gain, key, times = max(scored)
    return {**dict(key), "speedup_geomean_vs_default": gain, "us_by_shape": times, "default_us_by_shape": base}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=None, help="sliding window for every kernel (Gemma 3 local layers)")
    ap.add_argument("--kv-dtypes", default="bf16,fp8")
    ap.add_argument("--decode-batches", default="1,8,32,64,128,256")
    ap.add_argument("--decode-contexts", default="1024,4096,8192,32768")
    ap.add_argument("--max-decode-tokens", type=int, default=8 << 20, help="skip decode points above batch x ctx")
    ap.add_argument("--prefill-lens", default="128,512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--sweep", action="store_true", help="also time prefill tile configs (bf16 pool)")
    ap.add_argument("--best-out", default=None,
                    help="with --sweep: write the best config as JSON (what PDSERVE_PREFILL_CONFIG reads)")
    ap.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--new-kv", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill reads the new tokens' K/V from k/v (default); --no-new-kv: all from the pool")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU through Triton's interpreter (TRITON_INTERPRET=1): checks the script only")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.decode_batches, args.decode_contexts = ints(args.decode_batches), ints(args.decode_contexts)
    args.prefill_lens = ints(args.prefill_lens)
    if args.quick:
        args.decode_batches, args.decode_contexts = [1, 64, 256], [1024, 8192]
        args.prefill_lens = [1024, 8192]
    if args.cpu_smoke:
        args.hq, args.hk, args.head_dim = 4, 2, 32
        args.decode_batches, args.decode_contexts, args.prefill_lens = [1, 3], [40], [64]
        args.no_sdpa = True
        args.multi, args.chunk, args.prefix, args.mixed_decodes, args.sweep_lens = (2, 32), 16, 48, (3, 40), [64]
    else:
        args.multi, args.chunk, args.prefix, args.mixed_decodes, args.sweep_lens = (8, 1024), 512, 8192, (64, 2048), \
            [8192, 32768]
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    torch.manual_seed(0)
    rec = new_record("attention", {k: v for k, v in vars(args).items()})
    if args.cpu_smoke:
        hbm, tflops, gpu = 1.0, 1.0, "cpu (interpreter smoke run)"
    else:
        hbm, tflops, gpu = hbm_copy_gbps(dev), matmul_tflops(dev), torch.cuda.get_device_name(dev)
    rec["ceilings"] = {"gpu": gpu, "hbm_copy_gbps": hbm, "bf16_matmul_tflops": tflops,
                       "torch": torch.__version__, "triton": triton.__version__}
    print(f"{rec['ceilings']['gpu']}: HBM copy {hbm:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    rec["decode"], rec["prefill"], rec["mixed"], rec["sweep"] = [], [], [], []
    decode_tokens = max([b * c for b in args.decode_batches for c in args.decode_contexts
                         if b * c <= args.max_decode_tokens] + [0])
    extra = args.prefix + args.chunk
    need = max(decode_tokens, 2 * max(args.prefill_lens + args.sweep_lens + [extra]),
               args.mixed_decodes[0] * args.mixed_decodes[1] + extra + 4096)
    for name in args.kv_dtypes.split(","):
        pool = Pool(need, args.hk, args.head_dim, args.block_size, KV_DTYPES[name], dev)
        builder = AttentionMetadataBuilder(dev, 1024, 64, 64)  # compact layout: grows as needed
        rec["decode"] += run_decode(args, pool, builder, name, hbm, dev)
        rec["prefill"] += run_prefill(args, pool, builder, name, tflops, dev, not args.no_sdpa and name == "bf16")
        rec["mixed"].append(run_mixed(args, pool, builder, name, dev))
        if args.sweep and name == "bf16":
            rec["sweep"] += run_sweep(args, pool, builder, name, tflops, dev)
        del pool, builder
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.sweep:
        rec["sweep_best"] = best_of_sweep(rec["sweep"])
        print(f"sweep best: {rec['sweep_best']}", flush=True)
        if args.best_out and rec["sweep_best"]:
            with open(args.best_out, "w") as f:
                json.dump(rec["sweep_best"], f, indent=1)
    print(f"wrote {save_json(rec, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

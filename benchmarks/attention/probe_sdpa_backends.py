"""Prefill attention of one prompt's 8k chunks: pdserve's Triton kernel against torch's SDPA backends on one GPU.

The 32k prompt's TTFT is 1.12-1.19x vLLM's (FlashAttention 3 on Hopper); the Triton prefill kernel runs at 260-360
TFLOP/s on those chunks, about what torch's FlashAttention-2 backend does. This asks whether a library kernel that
torch already ships (cuDNN's fused attention, the flash and efficient backends) is faster on the same shapes, and
what it costs to feed it: the chunk's prefix gathered out of the paged pool into contiguous K/V.

For each (prefix, new tokens), all bf16, Hq x D = 32 x 128 over Hk = 8 (dummy Qwen3-8B):
  triton        pdserve's paged prefill (new tokens' K/V from the step's k/v, the prefix from the pool)
  gather        the prefix's K/V copied out of the pool (block table order) into [1, Hk, S, D]
  <backend>     SDPA on contiguous K/V with GQA: causal when there is no prefix, else lower-right causal
                (torch.nn.attention.bias.causal_lower_right), and the split form: prefix keys unmasked plus new
                keys causal, two calls merged by their log-sum-exp (private aten ops that return it)
Each output is checked against the Triton kernel's (max abs difference). Times: triton.testing.do_bench medians.

  python benchmarks/attention/probe_sdpa_backends.py --out $OUT/sdpa.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import Pool, causal_flops, new_kv, step_meta  # noqa: E402

from pdserve.bench.ceilings import matmul_tflops  # noqa: E402
from pdserve.bench.record import new_record, save_json  # noqa: E402
from pdserve.ops.attention import AttentionMetadataBuilder  # noqa: E402
from pdserve.ops.attention.kv_write import write_kv  # noqa: E402
from pdserve.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def gather(pool: Pool, table: torch.Tensor, n: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = pool.layer.index_select(0, table)  # [blocks, 2, bs, hk, d]
    k = g[:, 0].reshape(-1, hk, d)[:n].permute(1, 0, 2).unsqueeze(0)
    v = g[:, 1].reshape(-1, hk, d)[:n].permute(1, 0, 2).unsqueeze(0)
    return k, v


HQ, HK, D, BS = 32, 8, 128, 16


def run_case(ctx: int, t: int, dev: torch.device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    hq, hk, d, bs = HQ, HK, D, BS
    scale = d ** -0.5
    n = ctx + t
    pool = Pool(n + 1024, hk, d, bs, torch.bfloat16, dev)
    builder = AttentionMetadataBuilder(dev, max(t, 1024), 4, -(-n // bs) + 8)
    meta = step_meta(builder, pool, [n], [t])
    q = torch.randn((t, hq, d), dtype=torch.bfloat16, device=dev)
    k_new, v_new = new_kv(t, argparse.Namespace(hq=hq, hk=hk, head_dim=d), dev)
    write_kv(pool.layer, k_new, v_new, meta.slot_mapping, None, None)
    backend = TritonAttentionBackend()

    def triton_attn():
        return backend.attend(q, pool.layer, meta, scale, None, None, None, None, k_new=k_new, v_new=v_new)

    ref = triton_attn().clone()
    flops = causal_flops(hq, d, [n], [t], None)
    row = {"ctx": ctx, "new": t, "flops": flops, "triton_us": us(triton_attn)}
    table = torch.from_numpy(pool.tables([n])[0]).to(dev, torch.long)
    row["gather_us"] = us(lambda: gather(pool, table, n, hk, d)[0].contiguous())
    K, V = gather(pool, table, n, hk, d)
    K, V = K.contiguous(), V.contiguous()
    qq = q.permute(1, 0, 2).unsqueeze(0)  # [1, hq, t, d] (a view; strides of [t, hq, d])
    line = (f"ctx {ctx:6} + {t:6}: triton {row['triton_us']:9.1f} us {flops / row['triton_us'] / 1e6:6.1f} "
            f"TFLOP/s | gather {row['gather_us']:7.1f} us")

    def full():
        mask = causal_lower_right(t, n) if ctx else None
        return torch.nn.functional.scaled_dot_product_attention(qq, K, V, attn_mask=mask, is_causal=not ctx,
                                                                scale=scale, enable_gqa=True)

    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(be):
                o = full()
                err = (o[0].permute(1, 0, 2).float() - ref.float()).abs().max().item()
                row[f"{name}_us"] = us(full)
            row[f"{name}_err"] = err
            line += f" | {name} {row[f'{name}_us']:9.1f} us {flops / row[f'{name}_us'] / 1e6:6.1f} ({err:.1e})"
        except Exception as e:  # a backend that refuses these inputs: say why
            row[f"{name}_error"] = str(e)[:300]
            line += f" | {name}: {type(e).__name__}"
            print(f"  {name} ctx={ctx}: {str(e)[:300]}", file=sys.stderr)
    if ctx:  # the split form with cuDNN: prefix unmasked + new causal, merged by LSE
        Kx = K.repeat_interleave(hq // hk, 1)
        Vx = V.repeat_interleave(hq // hk, 1)

        def split():
            o1, l1 = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qq, Kx[:, :, :ctx], Vx[:, :, :ctx], None, True, 0.0, False, False, scale=scale)[:2]
            o2, l2 = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qq, Kx[:, :, ctx:], Vx[:, :, ctx:], None, True, 0.0, True, False, scale=scale)[:2]
            l1, l2 = l1.reshape(o1.shape[:-1]).float(), l2.reshape(o2.shape[:-1]).float()
            m = torch.maximum(l1, l2)
            w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
            return ((o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)).to(o1.dtype)

        try:
            o = split()
            err = (o[0].permute(1, 0, 2).float() - ref.float()).abs().max().item()
            row["cudnn_split_us"] = us(split)
            row["cudnn_split_err"] = err
            line += f" | cudnn split {row['cudnn_split_us']:9.1f} us ({err:.1e})"
        except Exception as e:
            row["cudnn_split_error"] = str(e)[:300]
            print(f"  cudnn split ctx={ctx}: {str(e)[:300]}", file=sys.stderr)
    print(line, flush=True)
    return row


def first_calls(dev: torch.device, cases: list[tuple[int, int]]) -> list[dict]:
    """The Triton backend's attend on rows the library takes, each shape new to the process: the first call
    (cuDNN builds an execution plan per shape) against the next one."""
    import time

    from pdserve.ops.attention import library_prefill as lib

    rows = []
    for ctx, t in cases:
        n = ctx + t
        pool = Pool(n + 1024, HK, D, BS, torch.bfloat16, dev)
        builder = AttentionMetadataBuilder(dev, max(t, 1024), 4, -(-n // BS) + 8)
        q = torch.randn((t, HQ, D), dtype=torch.bfloat16, device=dev)
        k_new, v_new = new_kv(t, argparse.Namespace(hq=HQ, hk=HK, head_dim=D), dev)
        times = []
        for _ in range(3):
            meta = step_meta(builder, pool, [n], [t])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            TritonAttentionBackend().attend(q, pool.layer, meta, D ** -0.5, None, None, None, None, k_new=k_new,
                                            v_new=v_new)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        took = meta.library is not None and meta.library[0] is not None
        rows.append({"ctx": ctx, "new": t, "library": took, "ms": times, "expand_kv": lib._expand_kv})
        print(f"first calls ctx {ctx:6} + {t:6} ({'cuDNN' if took else 'Triton'}): "
              + ", ".join(f"{x:.2f}" for x in times) + " ms", flush=True)
        del pool, builder
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="0:8192,8192:8192,16384:8192,24576:8192,0:32768,0:2048,2048:2048,0:512")
    ap.add_argument("--first-calls", default="", help="ctx:new,...: time the backend's first calls on new shapes")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    tflops_ceiling = matmul_tflops(dev)
    print(f"{torch.cuda.get_device_name(dev)}: bf16 matmul {tflops_ceiling:.0f} TFLOP/s; torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}", flush=True)
    rec = new_record("sdpa_backends", vars(args))
    rec["ceilings"] = {"gpu": torch.cuda.get_device_name(dev), "bf16_matmul_tflops": tflops_ceiling}
    rec["rows"] = []
    if args.first_calls:
        rec["first_calls"] = first_calls(dev, [tuple(int(x) for x in c.split(":")) for c in args.first_calls.split(",")])
    for case in filter(None, args.cases.split(",")):
        ctx, t = (int(x) for x in case.split(":"))
        rec["rows"].append(run_case(ctx, t, dev))
        torch.cuda.empty_cache()
    save_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

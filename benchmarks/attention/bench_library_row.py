"""One long prefill row through cuDNN (pdserve.ops.attention.library_prefill) and what feeding it costs, on the
engine's real pool layout: the 32k prompt's 8k chunks of dummy Qwen3-8B (Hq x D = 32 x 128 over 8 KV heads, bf16).

Per (prefix, new tokens), triton.testing.do_bench medians in microseconds:
  gather_old   the prefix's K/V by torch's index_select over the layer's strided view (before session 21)
  gather       the same by library_prefill.gather_prefix (the Triton kernel on CUDA)
  row_old      the whole row as before session 21: index_select gather, zero-filled padded copies of q/k/v for
               each call, the two cuDNN calls, the merge
  row          the whole row as library_prefill runs it now
  calls        the two cuDNN calls alone, on inputs made beforehand (what the row cannot go below) and the merge
and the row's TFLOP/s (causal pairs) for each. The two rows' outputs are compared (max abs difference).

--fa3 (where vLLM's wheel is importable, e.g. PYTHONPATH=/tmp/site after lease_2xh200.sh unpack): also
  fa3          vLLM's FlashAttention 3 (vllm.vllm_flash_attn.flash_attn_varlen_func, fa_version=3) over the same
               row, the new tokens' K/V written into the pool first, reading the prefix's pages where they lie (the
               layer's strided view as FA3's paged cache; a contiguous copy of the layer if FA3 refuses the view),
               compared with the row's output: what the kernel vLLM runs there reaches on these shapes

    python benchmarks/attention/bench_library_row.py --out $OUT/library_row.json
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from pdserve.bench.record import new_record, save_json
from pdserve.model.forward_context import layer_view
from pdserve.ops.attention import library_prefill as lib
from pdserve.ops.attention.merge import merge_two

HQ, HK, D, BS, LAYERS = 32, 8, 128, 16, 2


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def gather_old(kv_layer: torch.Tensor, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    bs, hk, d = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    blocks = table[: -(-ctx // bs)].long()
    k = kv_layer[:, 0].index_select(0, blocks).view(-1, hk, d)[:ctx]
    v = kv_layer[:, 1].index_select(0, blocks).view(-1, hk, d)[:ctx]
    return k, v


def padded_old(rows, length):
    x0 = rows[0][0]
    buf = torch.zeros((length, *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
    for x, at in rows:
        buf[at: at + x.shape[0]].copy_(x)
    return buf


def row_old(qr, kr, vr, kv_layer, table, ctx, scale, out):
    kp = vp = None
    if ctx:
        kp, vp = gather_old(kv_layer, table, ctx)
    hq, q_len = qr.shape[1], qr.shape[0]
    c0, qa, sb, r = lib.bucketed_shapes(q_len, ctx)
    qb = padded_old([(qr, r)], sb)
    kb = padded_old([(kp[c0:], 0), (kr, r)] if r else [(kr, 0)], sb)
    vb = padded_old([(vp[c0:], 0), (vr, r)] if r else [(vr, 0)], sb)
    hf = lib._heads_first
    ob, lb = lib._cudnn(hf(qb), hf(kb), hf(vb), scale, True, c0 > 0)
    if c0 == 0:
        out.copy_(ob[0, :, r: r + q_len].transpose(0, 1))
        return
    qa_buf = padded_old([(qr, 0)], qa)
    oa, la = lib._cudnn(hf(qa_buf), hf(kp[:c0]), hf(vp[:c0]), scale, False, True)
    merge_two(oa[0, :, :q_len], la.reshape(hq, qa)[:, :q_len], ob[0, :, r: r + q_len],
              lb.reshape(hq, sb)[:, r: r + q_len], out)


def row_new(qr, kr, vr, kv_layer, table, ctx, scale, out):
    kp = vp = None
    if ctx:
        kp, vp = lib.gather_prefix(kv_layer, table, ctx)
    lib.attend_row(qr, kr, vr, kp, vp, scale, out)


def write_new_kv(kv_layer, table, ctx, kr, vr) -> None:
    """The new tokens' K/V into the row's pages after its ctx cached tokens, as the engine's KV write puts them
    before attention."""
    idx = torch.arange(ctx, ctx + kr.shape[0], device=kr.device)
    blocks, offs = table[idx // BS].long(), idx % BS
    kv_layer[blocks, 0, offs] = kr
    kv_layer[blocks, 1, offs] = vr


def fa3_row(fa, qr, kr, vr, kv_layer, table, ctx, scale, res) -> None:
    """res["fa3_*"]: FA3 over the row with its K/V in the pool (they are written there first, as vLLM's backend
    has them before it attends), on the layer's strided view or, where FA3 refuses it, a contiguous copy."""
    t, n = qr.shape[0], ctx + kr.shape[0]
    write_new_kv(kv_layer, table, ctx, kr, vr)
    cu_q = torch.tensor([0, t], dtype=torch.int32, device=qr.device)
    used = torch.tensor([n], dtype=torch.int32, device=qr.device)
    bt = table[: -(-n // BS)][None].contiguous()
    out = torch.empty((t, HQ, D), dtype=qr.dtype, device=qr.device)

    def call(k, v):
        fa(qr, k, v, max_seqlen_q=t, cu_seqlens_q=cu_q, max_seqlen_k=n, seqused_k=used, softmax_scale=scale,
           causal=True, block_table=bt, out=out, fa_version=3)

    k, v = kv_layer[:, 0], kv_layer[:, 1]  # [blocks, BS, HK, D], strided: the pool's pages where they lie
    try:
        call(k, v)
        torch.cuda.synchronize()
        res["fa3_layout"] = "pool view"
    except RuntimeError as e:
        res["fa3_view_error"] = str(e)[:300]
        k, v = k.contiguous(), v.contiguous()
        call(k, v)
        res["fa3_layout"] = "contiguous copy"
    res["fa3_out"] = out
    res["fa3_us"] = us(lambda: call(k, v))


def row_inputs(ctx: int, t: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """One row of ctx cached and t new tokens: a pool in the engine's head-major layout (random values, 64 spare
    blocks), its layer view ([blocks, 2, BS, Hk, D], strided), the row's block table (random pages) and the new
    tokens' q, k and v as views of one fused projection: (pool, kv_layer, table, qr, kr, vr)."""
    n = ctx + t
    nb = -(-n // BS) + 64
    pool = torch.empty((nb, HK, LAYERS, 2, BS, D), dtype=torch.bfloat16, device=dev).normal_()
    kv_layer = layer_view(pool, 1)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(nb, generator=g)[: -(-n // BS)].to(torch.int32).to(dev)
    qkv = torch.randn((t, (HQ + 2 * HK) * D), dtype=torch.bfloat16, device=dev)
    qr = qkv[:, : HQ * D].view(t, HQ, D)
    kr = qkv[:, HQ * D: (HQ + HK) * D].view(t, HK, D)
    vr = qkv[:, (HQ + HK) * D:].view(t, HK, D)
    return pool, kv_layer, table, qr, kr, vr


def run_case(ctx: int, t: int, dev: torch.device, fa=None) -> dict:
    scale = D ** -0.5
    pool, kv_layer, table, qr, kr, vr = row_inputs(ctx, t, dev)
    out_old = torch.empty((t, HQ, D), dtype=torch.bfloat16, device=dev)
    out_new = torch.empty_like(out_old)
    res = {"ctx": ctx, "new": t}
    if ctx:
        ko, vo = gather_old(kv_layer, table, ctx)
        kn, vn = lib.gather_prefix(kv_layer, table, ctx)
        res["gather_equal"] = bool(torch.equal(ko, kn) and torch.equal(vo, vn))
        res["gather_old_us"] = us(lambda: gather_old(kv_layer, table, ctx))
        res["gather_us"] = us(lambda: lib.gather_prefix(kv_layer, table, ctx))
        res["gather_GBps"] = 2 * 2 * ctx * HK * D * 2 / (res["gather_us"] * 1e-6) / 1e9  # read + write, K and V
    row_old(qr, kr, vr, kv_layer, table, ctx, scale, out_old)
    row_new(qr, kr, vr, kv_layer, table, ctx, scale, out_new)
    res["max_abs_diff"] = (out_old.float() - out_new.float()).abs().max().item()
    res["row_old_us"] = us(lambda: row_old(qr, kr, vr, kv_layer, table, ctx, scale, out_old))
    res["row_us"] = us(lambda: row_new(qr, kr, vr, kv_layer, table, ctx, scale, out_new))
    # the calls alone, on inputs made beforehand
    c0, qa, sb, r = lib.bucketed_shapes(t, ctx)
    hf = lib._heads_first
    qb = lib._padded([(qr, r)], sb)
    kp, vp = lib.gather_prefix(kv_layer, table, ctx) if ctx else (None, None)
    kb = lib._padded([(kp[c0:], 0), (kr, r)] if r else [(kr, 0)], sb)
    vb = lib._padded([(vp[c0:], 0), (vr, r)] if r else [(vr, 0)], sb)

    def calls():
        ob, lb = lib._cudnn(hf(qb), hf(kb), hf(vb), scale, True, c0 > 0)
        if c0:
            oa, la = lib._cudnn(hf(qb[:qa]), hf(kp[:c0]), hf(vp[:c0]), scale, False, True)
            merge_two(oa[0, :, :t], la.reshape(HQ, qa)[:, :t], ob[0, :, r: r + t], lb.reshape(HQ, sb)[:, r: r + t],
                      out_new)

    res["calls_us"] = us(calls)
    timed = ["row_old", "row", "calls"]
    if fa is not None:
        fa3_row(fa, qr, kr, vr, kv_layer, table, ctx, scale, res)
        row_new(qr, kr, vr, kv_layer, table, ctx, scale, out_new)
        res["fa3_max_abs_diff"] = (res.pop("fa3_out").float() - out_new.float()).abs().max().item()
        timed.append("fa3")
    flops = 4.0 * HQ * D * (t * ctx + t * (t + 1) / 2)
    for k in timed:
        res[f"{k}_tflops"] = flops / (res[f"{k}_us"] * 1e-6) / 1e12
    del pool
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="0:8192,8192:8192,16384:8192,24576:8192,4096:4096,2500:4096",
                    help="prefix:new pairs")
    ap.add_argument("--fa3", action="store_true", help="also vLLM's FlashAttention 3 over the same rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    fa = None
    if args.fa3:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as fa
    if not lib.enabled(dev):
        raise SystemExit("cuDNN attention is not available here (needs sm_90+ and cuDNN)")
    rec = new_record("library_row", {"hq": HQ, "hk": HK, "d": D, "block_size": BS, "dtype": "bf16"})
    rec["results"] = []
    for pair in args.cases.split(","):
        ctx, t = (int(x) for x in pair.split(":"))
        r = run_case(ctx, t, dev, fa)
        rec["results"].append(r)
        g = (f"gather {r['gather_old_us']:7.1f} -> {r['gather_us']:6.1f} us ({r['gather_GBps']:.0f} GB/s, "
             f"equal {r['gather_equal']}); " if ctx else "")
        print(f"ctx {ctx:6d} + {t:5d}: {g}row {r['row_old_us']:8.1f} -> {r['row_us']:8.1f} us "
              f"({r['row_old_tflops']:.0f} -> {r['row_tflops']:.0f} TFLOP/s); calls alone {r['calls_us']:8.1f} us "
              f"({r['calls_tflops']:.0f}); max |diff| {r['max_abs_diff']:.2e}", flush=True)
        if fa is not None:
            print(f"  fa3 ({r['fa3_layout']}) {r['fa3_us']:8.1f} us ({r['fa3_tflops']:.0f} TFLOP/s), row / fa3 "
                  f"{r['row_us'] / r['fa3_us']:.3f}; max |diff| against the row {r['fa3_max_abs_diff']:.2e}"
                  + (f"; the view refused: {r['fa3_view_error'][:120]}" if "fa3_view_error" in r else ""), flush=True)
    if args.out:
        save_json(rec, args.out)


if __name__ == "__main__":
    main()

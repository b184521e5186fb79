"""Long prefill rows through cuDNN's frontend graph API (the `nvidia-cudnn-frontend` package) in place of torch's
SDPA op, on the engine's real pool layout: the 32k prompt's 8k chunks of dummy Qwen3-8B (Hq x D = 32 x 128 over 8
KV heads, bf16, blocks of 16 tokens in random pages).

pdserve's library row (pdserve.ops.attention.library_prefill) reaches cuDNN through torch's SDPA op, which has no
bottom-right causal mask and no paged K/V: it gathers the prefix out of the pool, makes two calls (a causal one
over the new tokens, an unmasked one against the prefix) and merges them. The frontend graph has both. Arms per
(prefix, new tokens), triton.testing.do_bench medians in microseconds:
  row         the library row as shipped (gather, the two calls, the merge)
  dense       one frontend call, causal aligned bottom-right, over the prefix gathered by the row's kernel and the
              new tokens' K/V (one contiguous copy of both; `dense_call`: the call alone on inputs made beforehand)
  gathered    the same call over the whole row's K/V (prefix and new, written into the pool first, as the engine's
              KV write does before attention) gathered out of the pool by the row's gather kernel in one launch
  paged       one frontend call, causal aligned bottom-right, reading every K/V token where it lies in the pool
              through a page table: no gather, no copy, no merge
  padded      a graph at the case's dims serving 192 fewer new tokens (and 100 fewer prefix tokens) through its
              padding mask (lengths given at run time), against a graph of the exact dims on the same inputs: whether
              one graph can serve a bucket of lengths, and at what cost
For each frontend graph every plan cuDNN's heuristics (modes A and FALLBACK) propose is built and timed: the first
(the heuristics' choice) and the fastest are reported, each plan's output compared with the row's. --interleave N
then times the row and the gathered arm (its gather inside the timed call; the first plan and the fastest) one after
the other, N rounds, so a drift of the GPU's speed falls on every arm alike.

    pip install --no-deps --target /tmp/cfe nvidia_cudnn_frontend-*.whl
    PYTHONPATH=/tmp/cfe python benchmarks/attention/probe_cudnn_frontend.py --out $OUT/cudnn_fe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pdserve.bench.record import new_record, save_json
from pdserve.ops.attention import library_prefill as lib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_library_row import BS, HK, HQ, D, row_inputs, us, write_new_kv  # noqa: E402
from bench_library_row import row_new as row  # noqa: E402


def bhsd(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] (any row stride) as the [1, heads, tokens, D] view cuDNN's graph describes."""
    return x.permute(1, 0, 2).unsqueeze(0)


class FeGraph:
    """One bottom-right causal SDPA graph of the frontend, its plans built, and the buffers of one call."""

    def __init__(self, cudnn, handle, q4, k4, v4, o4, scale, paged=None, lengths=None):
        bf16 = cudnn.data_type.BFLOAT16
        g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def tensor(name, x, dtype=bf16):
            return g.tensor(name=name, dim=list(x.shape), stride=list(x.stride()), data_type=dtype)

        q, k, v = tensor("q", q4), tensor("k", k4), tensor("v", v4)
        self.pack = {q: q4, k: k4, v: v4}
        kw = {}
        if lengths is not None:  # the graph at its dims, the call's lengths at run time (a padding mask)
            sq_buf, skv_buf = lengths
            i32 = cudnn.data_type.INT32
            sq, skv = tensor("seq_q", sq_buf, i32), tensor("seq_kv", skv_buf, i32)
            self.pack.update({sq: sq_buf, skv: skv_buf})
            kw = dict(use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
        if paged is not None:
            table4, sq_buf, skv_buf, max_kv = paged
            i32 = cudnn.data_type.INT32
            kt, vt = tensor("k_table", table4, i32), tensor("v_table", table4, i32)
            sq, skv = tensor("seq_q", sq_buf, i32), tensor("seq_kv", skv_buf, i32)
            self.pack.update({kt: table4, vt: table4, sq: sq_buf, skv: skv_buf})
            kw = dict(use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv, paged_attention_k_table=kt,
                      paged_attention_v_table=vt, paged_attention_max_seq_len_kv=max_kv)
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=scale, generate_stats=False,
                      diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0, **kw)
        o.set_output(True).set_dim(list(o4.shape)).set_stride(list(o4.stride())).set_data_type(bf16)
        self.pack[o] = o4
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        self.g, self.handle = g, handle
        self.count = g.get_execution_plan_count()
        sizes = []
        for i in range(self.count):
            try:
                sizes.append(g.get_workspace_size_plan_at_index(i))
            except Exception:  # a plan that did not build has no size
                sizes.append(0)
        try:
            sizes.append(g.get_workspace_size())  # the selected plan's (raises where none is selected)
        except Exception:
            pass
        self.workspace = torch.empty(max(sizes + [1]), dtype=torch.uint8, device=q4.device)

    def name(self, i: int) -> str:
        try:
            return self.g.get_plan_name_at_index(i)
        except Exception as e:  # older frontends name no plan
            return f"plan {i} ({type(e).__name__})"

    def run(self, i: int) -> None:
        self.g.execute_plan_at_index(self.pack, self.workspace, i, self.handle)


def sweep(fe: FeGraph, out: torch.Tensor, ref: torch.Tensor, extra=None) -> dict:
    """Every plan of `fe` timed (with `extra` before each call where given) and compared with `ref`."""
    plans = []
    for i in range(fe.count):
        p = {"index": i, "name": fe.name(i)}
        try:
            out.zero_()
            fe.run(i)
            torch.cuda.synchronize()
            p["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
            p["us"] = us(lambda i=i: fe.run(i))
            if extra is not None:
                p["with_inputs_us"] = us(lambda i=i: (extra(), fe.run(i)))
        except Exception as e:  # a plan the backend refuses at run time
            p["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        plans.append(p)
    ok = [p for p in plans if "us" in p]
    return {"plans": plans, "first": ok[0] if ok else None, "best": min(ok, key=lambda p: p["us"]) if ok else None}


def run_case(cudnn, handle, ctx: int, t: int, dev: torch.device, rounds: int = 0) -> dict:
    scale = D ** -0.5
    n = ctx + t
    pool, kv_layer, table, qr, kr, vr = row_inputs(ctx, t, dev)
    ref = torch.empty((t, HQ, D), dtype=torch.bfloat16, device=dev)
    row(qr, kr, vr, kv_layer, table, ctx, scale, ref)
    res = {"ctx": ctx, "new": t, "row_us": us(lambda: row(qr, kr, vr, kv_layer, table, ctx, scale, ref))}
    out = torch.empty_like(ref)

    # dense: the prefix gathered by the row's kernel and the new tokens in one contiguous K and V
    kd = torch.empty((n, HK, D), dtype=torch.bfloat16, device=dev)
    vd = torch.empty_like(kd)

    def inputs() -> None:
        if ctx:
            kp, vp = lib.gather_prefix(kv_layer, table, ctx)
            kd[:ctx].copy_(kp)
            vd[:ctx].copy_(vp)
        kd[ctx:].copy_(kr)
        vd[ctx:].copy_(vr)

    inputs()
    try:
        fe = FeGraph(cudnn, handle, bhsd(qr), bhsd(kd), bhsd(vd), bhsd(out), scale)
        res["dense"] = sweep(fe, out, ref, inputs)
        res["dense_inputs_us"] = us(inputs)
    except Exception as e:
        res["dense_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    # the new tokens' K/V written into the pool (as the engine's KV write does before attention)
    write_new_kv(kv_layer, table, ctx, kr, vr)

    # gathered: the whole row's K/V (prefix and new) out of the pool by the row's gather kernel in one launch, into
    # one buffer, then one call
    nblk = -(-n // BS)
    buf = torch.empty((2, nblk * BS, HK, D), dtype=torch.bfloat16, device=dev)
    tab = table[:nblk].contiguous()

    def gather_all() -> None:
        lib._gather_blocks_kernel[(nblk, 2)](
            kv_layer, tab, buf, tab, tab, kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
            kv_layer.stride(3), buf.stride(0), HK=HK, D=D, BS=BS, BLOCK_H=HK, BLOCK_D=D, DEQUANT=False,
            HAS_KS=False, HAS_VS=False, num_warps=4)

    gather_all()
    try:
        fe = FeGraph(cudnn, handle, bhsd(qr), bhsd(buf[0, :n]), bhsd(buf[1, :n]), bhsd(out), scale)
        res["gathered"] = sweep(fe, out, ref, gather_all)
        res["gather_all_us"] = us(gather_all)
        if rounds and res["gathered"]["best"] is not None:
            # the row and the gathered arm (its gather inside the timed call) one after the other, round by round
            first, best = res["gathered"]["first"]["index"], res["gathered"]["best"]["index"]
            arms = {"row": lambda: row(qr, kr, vr, kv_layer, table, ctx, scale, ref),
                    "gathered_first": lambda: (gather_all(), fe.run(first)),
                    "gathered_best": lambda: (gather_all(), fe.run(best))}
            res["interleaved"] = {k: [] for k in arms}
            for _ in range(rounds):
                for k, fn in arms.items():
                    res["interleaved"][k].append(us(fn))
    except Exception as e:
        res["gathered_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    # padded: the graph at this case's dims, a call of fewer tokens through a padding mask (seq_len_q/kv at run
    # time), against the same call on a graph of the exact dims: can one graph serve a bucket of lengths?
    t2, c2 = t - 192, max(ctx - 100, 0)
    n2 = c2 + t2
    qp = torch.randn((t, HQ, D), dtype=torch.bfloat16, device=dev)
    kvp = torch.randn((2, n, HK, D), dtype=torch.bfloat16, device=dev)
    op = torch.zeros((t, HQ, D), dtype=torch.bfloat16, device=dev)
    exact = torch.empty((t2, HQ, D), dtype=torch.bfloat16, device=dev)
    sq2 = torch.full((1, 1, 1, 1), t2, dtype=torch.int32, device=dev)
    skv2 = torch.full((1, 1, 1, 1), n2, dtype=torch.int32, device=dev)
    try:
        fx = FeGraph(cudnn, handle, bhsd(qp[:t2]), bhsd(kvp[0, :n2]), bhsd(kvp[1, :n2]), bhsd(exact), scale)
        fx.run(0)
        res["padded_exact"] = sweep(fx, exact, exact.clone())
        fp = FeGraph(cudnn, handle, bhsd(qp), bhsd(kvp[0]), bhsd(kvp[1]), bhsd(op), scale, lengths=(sq2, skv2))
        res["padded"] = sweep(fp, op[:t2], exact)
        res["padded_lengths"] = {"graph_q": t, "graph_kv": n, "q": t2, "kv": n2}
    except Exception as e:
        res["padded_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    # paged: every token read where it lies in the pool
    kc = kv_layer[:, 0].permute(0, 2, 1, 3)  # [blocks, HK, BS, D]: the container cuDNN pages through
    vc = kv_layer[:, 1].permute(0, 2, 1, 3)
    table4 = table.view(1, 1, -1, 1).contiguous()
    sq = torch.full((1, 1, 1, 1), t, dtype=torch.int32, device=dev)
    skv = torch.full((1, 1, 1, 1), n, dtype=torch.int32, device=dev)
    try:
        fe = FeGraph(cudnn, handle, bhsd(qr), kc, vc, bhsd(out), scale,
                     paged=(table4, sq, skv, table4.shape[2] * BS))
        res["paged"] = sweep(fe, out, ref)
    except Exception as e:
        res["paged_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    flops = 4.0 * HQ * D * (t * ctx + t * (t + 1) / 2)
    res["row_tflops"] = flops / (res["row_us"] * 1e-6) / 1e12
    for arm in ("dense", "gathered", "paged"):
        for which in ("first", "best"):
            p = (res.get(arm) or {}).get(which)
            if p:
                p["tflops"] = flops / (p["us"] * 1e-6) / 1e12
    del pool
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="0:8192,8192:8192,16384:8192,24576:8192", help="prefix:new pairs")
    ap.add_argument("--interleave", type=int, default=0,
                    help="rounds of the row and the gathered arm (first and best plan) timed one after the other")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    if not lib.enabled(dev):
        raise SystemExit("cuDNN attention is not available here (needs sm_90+ and cuDNN)")
    torch.nn.functional.scaled_dot_product_attention(  # torch's cuDNN loaded before the frontend looks for it
        *(torch.zeros((1, 1, 64, 64), dtype=torch.bfloat16, device=dev),) * 3)
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rec = new_record("cudnn_frontend_row", {"hq": HQ, "hk": HK, "d": D, "block_size": BS, "dtype": "bf16",
                                            "frontend": cudnn.__version__, "backend": cudnn.backend_version(),
                                            "torch_cudnn": torch.backends.cudnn.version()})
    print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version()}, torch's cuDNN "
          f"{torch.backends.cudnn.version()}", flush=True)
    rec["results"] = []
    for pair in args.cases.split(","):
        ctx, t = (int(x) for x in pair.split(":"))
        r = run_case(cudnn, handle, ctx, t, dev, args.interleave)
        rec["results"].append(r)
        line = f"ctx {ctx:6d} + {t:5d}: row {r['row_us']:8.1f} us ({r['row_tflops']:.0f} TFLOP/s)"
        for arm in ("dense", "gathered", "paged", "padded_exact", "padded"):
            if f"{arm}_error" in r:
                line += f"; {arm} failed: {r[f'{arm}_error'][:160]}"
                continue
            if arm not in r:
                continue
            a = r[arm]
            if a["best"] is None:
                line += f"; {arm}: no plan ran ({len(a['plans'])}: {a['plans'][0].get('error', '')[:120]})"
                continue
            f, b = a["first"], a["best"]
            inp = f", with its inputs {b['with_inputs_us']:.1f}" if "with_inputs_us" in b else ""
            rate = f"{b['tflops']:.0f} TFLOP/s" if "tflops" in b else f"{r.get('padded_lengths')}"
            line += (f"\n  {arm}: {len(a['plans'])} plans; first {f['us']:.1f} us; best {b['us']:.1f} us "
                     f"({rate}{inp}), row / best {r['row_us'] / b['us']:.3f}, max |diff| "
                     f"{b['max_abs_diff']:.1e}, {b['name'][:60]}")
        if "interleaved" in r:
            med = {k: sorted(v)[len(v) // 2] for k, v in r["interleaved"].items()}
            line += ("\n  interleaved, median of " + str(args.interleave) + " rounds: "
                     + ", ".join(f"{k} {v:.1f} us" for k, v in med.items())
                     + f"; row / gathered_best {med['row'] / med['gathered_best']:.3f}; rounds: "
                     + " | ".join(" ".join(f"{x:.0f}" for x in v) for v in r["interleaved"].values()))
        print(line, flush=True)
    if args.out:
        save_json(rec, args.out)


if __name__ == "__main__":
    main()

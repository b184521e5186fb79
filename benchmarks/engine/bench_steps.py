"""Engine step times against their floors measured in the same run (issue 10), and a profile of one step.

Each case is one runner step built by hand (requests with KV already in the pool, no scheduler), executed
repeatedly; the time is the wall time of `ModelRunner.execute` (inputs, forward, logits, sampling: it ends with
the sampled tokens on the host). Floors, from ceilings measured in the same process:

  memory floor  = (weight bytes read + KV bytes read) / measured HBM copy rate
  compute floor = matmul FLOPs (linear layers, LM head on sampled rows, causal attention) / measured bf16 matmul
                  (a mixture of experts: each token multiplies its top_k experts, and a step reads the experts its
                  tokens route to, expected under uniform routing; records before session 34 counted every expert's
                  bytes in every step and no expert FLOPs)
  floor         = the larger of the two (decode: memory; prefill: compute; mixed: whichever binds)
  serial bound  = the attention's larger part (KV read or attention FLOPs) plus the products' (weights' read or
                  their FLOPs): what a step whose attention and products do not overlap cannot beat (at 256 decode
                  rows the products are compute-bound, so it lies above the floor)

Default cases: steady decode at batch 1 and 256 with ~1k context, batch 1 and 32 with ~8k, an 8k-token prefill,
and a mixed step (256 decodes at ~1k + a 512-token prefill chunk). With --compare-eager (default) every case also
runs with the captured graphs switched off, and decode steps that replay a full graph also run through the
piecewise graphs. --profile CASE prints the top kernels of that step and its kernel count.

Async scheduling (--loop, default batch 1 and 256 at ~1k context): steady decoding through the whole engine
(`EngineCore.step`: scheduler, inputs, forward, sampling, request updates), with async scheduling off (each step
waits for its sampled ids before the next is scheduled) and on (step n+1 is scheduled and launched while step n
runs); the time per step is the wall time of many steps divided by their number, and the host time per step is
the wall time outside the device's wait (`EngineCore.step` minus the time spent in collect).

  python benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --out $OUT/steps.json
  python benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --profile decode:256x1024 \
      --out $OUT/profile.json
  python benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --decode "" --prefill "" \
      --mixed "" --loop 1x1024,256x1024 --out $OUT/async.json

Prompt bursts (--burst NxL): N prompts of L tokens added at once, as a concurrency-N client's first wave, stepped
through `EngineCore.step` until every one has its first token: the prompt tokens per second the engine sustains
while its running requests decode (what sets TTFT at high concurrency), beside the per-step cases (prefill:8x1024
is eight whole prompts in one step; mixed:128x512+8x1008 is 128 decodes beside eight prompts).

  CPU smoke run (numbers meaningless): --model qwen3-0.6b --device cpu --decode 2x64 --prefill 64 --mixed 2x64+32,2x64+2x16 \
      --loop 2x64 --loop-steps 5 --burst 4x16
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections import defaultdict

import torch

from pdserve.bench.record import new_record, save_json
from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.sampling_params import SamplingParams


# ---- ablation (an upper bound on what fusing a kernel away can save; the model's outputs are wrong)
def ablate(kinds: list[str]) -> None:
    from pdserve.model import layers
    from pdserve.ops.attention import triton_backend
    for kind in kinds:
        if kind == "norm":
            layers.rms_norm = lambda x, w, eps, offset=0.0: x
            layers.fused_add_rms_norm = lambda x, r, w, eps, offset=0.0: (x, x)
        elif kind == "act":
            layers.act_and_mul = lambda x, act: x[..., : x.shape[-1] // 2]
        elif kind == "kv_write":
            triton_backend.write_kv = lambda *a, **kw: None
            triton_backend.TritonAttentionBackend.writes_kv_early = False  # nor by the rotary kernel
        else:
            raise SystemExit(f"--ablate: unknown kernel {kind!r} (norm, act, kv_write)")
    print(f"ablated (outputs wrong, timings only): {','.join(kinds)}", flush=True)


# ---- ceilings
def ceilings(device: torch.device) -> dict:
    if device.type == "cuda":
        from pdserve.bench.ceilings import measure

        return measure(device)
    a = torch.empty(1 << 28, dtype=torch.uint8)
    b = torch.empty_like(a)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    copy_gbps = 2 * 5 * a.numel() / (time.perf_counter() - t) / 1e9
    m = torch.randn(1024, 1024)
    t = time.perf_counter()
    for _ in range(5):
        m @ m
    return {"gpu": None, "hbm_copy_gbps": copy_gbps,
            "bf16_matmul_tflops": 5 * 2 * 1024**3 / (time.perf_counter() - t) / 1e12, "note": "CPU fp32 stand-ins"}


# ---- model arithmetic
def model_sizes(core: EngineCore) -> dict:
    """The model's arithmetic for the floors: weight bytes every step reads, the layers' matrix parameters every token
    multiplies, the LM head, KV bytes a token and attention FLOPs a query-key pair. A mixture of experts' stacked
    expert weights are counted apart (expert_params, expert_bytes, num_experts, top_k): a token multiplies top_k of
    them, and a step reads those its tokens route to (floors)."""
    from pdserve.model.moe import FusedMoE

    model = core.model
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    moe = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    read = body = expert_params = expert_bytes = 0
    for name, p in model.named_parameters():  # tied weights appear once
        nbytes = p.numel() * p.element_size()
        if name == "model.embed_tokens.weight" and not tied:
            continue  # a decode step reads only its rows
        if name.rpartition(".")[0] in moe:
            expert_params += p.numel()
            expert_bytes += nbytes
            continue
        read += nbytes
        if ".layers." in name and p.dim() == 2:
            body += p.numel()
    cfg = core.hf_config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    first = next(iter(moe.values()), None)
    return {"weight_bytes_read": read, "linear_params": body, "lm_head_params": model.lm_head.weight.numel(),
            "kv_bytes_per_token": core.block_bytes // core.config.block_size,
            "attn_flops_per_pair": 4 * cfg.num_attention_heads * hd * cfg.num_hidden_layers,
            "expert_params": expert_params, "expert_bytes": expert_bytes,
            "num_experts": first.num_experts if first else 0, "top_k": first.top_k if first else 0}


def experts_share(sizes: dict, tokens: int) -> float:
    """The expected share of a layer's experts that `tokens` tokens route to, if each picks its top_k experts
    uniformly at random and independently of the others: 1 - (1 - top_k / experts) ** tokens (0 without experts)."""
    e = sizes.get("num_experts", 0)
    return 1.0 - (1.0 - sizes["top_k"] / e) ** tokens if e else 0.0


def floors(sizes: dict, ceil: dict, seqs: list[tuple[int, int]], sampled: int) -> dict:
    """seqs: (cached tokens, new tokens) of each sequence of the step.

    The floor is the larger of the step's bytes at the HBM copy rate and its FLOPs at the matmul rate, as if its
    memory-bound and compute-bound work overlapped perfectly. The serial bound is what a step whose attention and
    products run one after the other cannot beat: the attention's larger of KV read and attention FLOPs, plus the
    products' larger of weights' read and their FLOPs (at 256 decode rows the products are compute-bound, so this
    bound lies above the floor). A mixture of experts' tokens each multiply top_k experts' weights, and the step
    reads the experts its tokens route to (experts_share: uniform routing assumed; sizes without experts: none)."""
    tokens = sum(n for _, n in seqs)
    pairs = sum(n * c + n * (n + 1) / 2 for c, n in seqs)
    experts = sizes.get("expert_params", 0) * sizes["top_k"] / sizes["num_experts"] if sizes.get("num_experts") else 0
    prod_flops = 2 * tokens * (sizes["linear_params"] + experts) + 2 * sampled * sizes["lm_head_params"]
    attn_flops = pairs * sizes["attn_flops_per_pair"]
    flops = prod_flops + attn_flops
    kv_read = sum(c + n for c, n in seqs) * sizes["kv_bytes_per_token"]
    weights = sizes["weight_bytes_read"] + sizes.get("expert_bytes", 0) * experts_share(sizes, tokens)
    hbm, mm = ceil["hbm_copy_gbps"] * 1e9 / 1e3, ceil["bf16_matmul_tflops"] * 1e12 / 1e3  # per ms
    mem_ms = (weights + kv_read) / hbm
    compute_ms = flops / mm
    serial_ms = max(kv_read / hbm, attn_flops / mm) + max(weights / hbm, prod_flops / mm)
    return {"tokens": tokens, "flops": flops, "attn_flops": attn_flops, "prod_flops": prod_flops,
            "kv_bytes_read": kv_read, "weight_bytes": weights, "memory_floor_ms": mem_ms,
            "compute_floor_ms": compute_ms, "floor_ms": max(mem_ms, compute_ms),
            "bound": "memory" if mem_ms >= compute_ms else "compute", "serial_bound_ms": serial_ms}


# ---- cases
def parse_cases(decode: str = "", prefill: str = "", mixed: str = "") -> list[tuple[str, list]]:
    """(name, [(cached, new, sampled)...]) per case."""
    cases = []
    for spec in filter(None, decode.split(",")):
        b, ctx = (int(x) for x in spec.split("x"))
        cases.append((f"decode:{spec}", [(ctx, 1, True)] * b))
    for spec in filter(None, prefill.split(",")):
        if "+" in spec:  # "C+N": the last chunk of a long prompt, N new tokens after C cached ones (KV present)
            c, n = (int(x) for x in spec.split("+"))
            cases.append((f"prefill:{spec}", [(c, n, True)]))
        else:
            cases.append((f"prefill:{spec}", _prompts(spec, True)))
    for spec in filter(None, mixed.split(",")):
        dec, chunk = spec.split("+")
        b, ctx = (int(x) for x in dec.split("x"))
        cases.append((f"mixed:{spec}", [(ctx, 1, True)] * b + _prompts(chunk, "x" in chunk)))
    return cases


def _prompts(spec: str, sampled: bool) -> list[tuple[int, int, bool]]:
    """"L": one prompt (chunk) of L tokens; "NxL": N of them in one step (whole prompts: each sampled)."""
    n, _, length = spec.rpartition("x")
    return [(0, int(length), sampled)] * int(n or 1)


def build_batch(core: EngineCore, name: str, seqs: list[tuple[int, int, bool]], rng: random.Random):
    """Requests whose first `cached` tokens have KV (blocks allocated) and whose next `new` tokens run now."""
    vocab = core.hf_config.vocab_size
    batch = ScheduledBatch()
    for i, (cached, new, sampled) in enumerate(seqs):
        total = cached + new + (0 if sampled else 1)  # an unsampled chunk is not the prompt's end
        req = Request(f"{name}-{i}", [rng.randrange(vocab) for _ in range(total)],
                      SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        if not core.kv.allocate(req, cached + new):
            for r in batch.requests:
                core.kv.free(r)
            return None
        req.num_computed_tokens = cached
        batch.requests.append(req)
        batch.num_new_tokens.append(new)
    return batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_case(core: EngineCore, batch: ScheduledBatch, iters: int, warmup: int) -> dict:
    runner = core.runner
    before = dict(runner.step_counts)
    for _ in range(warmup):
        runner.execute(batch)
    sync(core.device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(batch)
        sync(core.device)
        times.append((time.perf_counter() - t) * 1e3)
    path = max(runner.step_counts, key=lambda k: runner.step_counts[k] - before.get(k, 0))
    times.sort()
    return {"step_ms_median": statistics.median(times), "step_ms_p90": times[-(-9 * len(times) // 10) - 1],
            "step_ms_min": times[0], "path": path}


def time_burst(core: EngineCore, n: int, length: int, rng: random.Random) -> dict:
    """`n` prompts of `length` tokens added at once (a concurrency-n client's first wave): the wall time through
    `EngineCore.step` until every one has its first token, and each step's time and tokens."""
    vocab = core.hf_config.vocab_size
    params = SamplingParams(max_tokens=core.max_model_len - length, temperature=0.0, ignore_eos=True)
    rids = [f"burst-{n}x{length}-{i}" for i in range(n)]
    sync(core.device)
    t0 = time.perf_counter()
    for rid in rids:
        core.add_request(rid, [rng.randrange(vocab) for _ in range(length)], params)
    first: dict[str, float] = {}
    steps = []
    while len(first) < n:
        t = time.perf_counter()
        out = core.step()
        now = time.perf_counter()
        steps.append((now - t) * 1e3)
        for o in out:
            first.setdefault(o.request_id, now - t0)
    wall = time.perf_counter() - t0
    for rid in rids:
        core.abort_request(rid)
    while core.has_work():
        core.step()
    ttft = sorted(first.values())
    return {"case": f"burst:{n}x{length}", "wall_s": wall, "steps": len(steps), "prefill_tok_s": n * length / wall,
            "ttft_mean_s": sum(ttft) / n, "ttft_p90_s": ttft[-(-9 * n // 10) - 1], "step_ms": steps}


def profile_case(core: EngineCore, batch: ScheduledBatch, steps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    runner = core.runner
    for _ in range(3):
        runner.execute(batch)
    sync(core.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            runner.execute(batch)
        sync(core.device)
    return {**kernel_table(prof, steps, top), "gpu": gpu_timeline(prof, steps)}


def kernel_table(prof, steps: int, top: int) -> dict:
    """From a profile of `steps` steps: kernels (and copies) per step, their time per step, the `top` of them; with
    each, its marginal time (marginal_times) a step and by position in the step."""
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name].append(e.time_range.elapsed_us())
    marginal = marginal_times(prof)
    rows = sorted(((name, len(v) / steps, sum(v) / steps) for name, v in per_kernel.items()), key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    return {"steps": steps, "kernels_per_step": sum(r[1] for r in rows), "gpu_us_per_step": total_us,
            "top": [{"name": n, "count_per_step": c, "us_per_step": us, "share": us / total_us if total_us else 0,
                     "slots_us": kernel_slots(per_kernel[n], steps),
                     "marginal_us_per_step": sum(marginal[n]) / steps,
                     "marginal_slots_us": kernel_slots(marginal[n], steps)} for n, c, us in rows[:top]]}


def marginal_times(prof) -> dict[str, list[float]]:
    """Each device activity's marginal time, by name in start order: how far its end pushes the latest end of the
    activities that started before it (0 when it ends inside them). Their sum is the device's busy time. Under
    programmatic dependent launch a kernel starts while the one before it runs and waits, so its own span counts
    that wait; its marginal time is what it adds to the step."""
    ivs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    out: dict[str, list[float]] = defaultdict(list)
    frontier = None
    for s, e, name in ivs:
        base = s if frontier is None else max(s, frontier)
        out[name].append(max(0.0, e - base))
        frontier = e if frontier is None else max(frontier, e)
    return out


def kernel_slots(times_us: list[float], steps: int) -> list[float]:
    """A kernel's mean time at each of its positions within a step (its k-th launch of the step), from its launches
    in start order over `steps` steps of one repeated shape (a steady loop); [] where its count is not the same each
    step. With one launch per layer and kind (the one-row products: q/k/v, o, gate_up, down, then the LM head), the
    positions modulo the kinds tell the kinds apart (print_slots)."""
    per_step, rest = divmod(len(times_us), steps)
    if rest or per_step < 2:
        return []
    return [sum(times_us[i::per_step]) / steps for i in range(per_step)]


def print_slots(name: str, slots: list[float], period: int) -> None:
    """A kernel's positions folded by `period` launches (the kinds of a layer; the launches past the last whole
    period printed one by one): mean, min and max us a launch of each kind."""
    whole = len(slots) // period * period
    parts = [slots[r:whole:period] for r in range(period)] + [[t] for t in slots[whole:]]
    cells = [f"#{i}: {sum(p) / len(p):.2f} ({min(p):.2f}-{max(p):.2f})" for i, p in enumerate(parts)]
    print(f"  {name[:40]} by position mod {period}: " + "; ".join(cells))


def print_profile(label: str, p: dict) -> None:
    print(f"\nprofile {label}: {p['kernels_per_step']:.0f} kernels per step, {p['gpu_us_per_step'] / 1e3:.2f} ms "
          "of kernel time per step")
    print("| kernel | per step | us/step | share | marginal us/step |\n|---|---|---|---|---|")
    for r in p["top"]:
        mg = r.get("marginal_us_per_step")
        print(f"| {r['name'][:90]} | {r['count_per_step']:.0f} | {r['us_per_step']:.0f} | {r['share']:.1%} | "
              + (f"{mg:.0f}" if mg is not None else "") + " |")
    layers = p.get("layers") or 0
    for key, what in (("slots_us", ""), ("marginal_slots_us", " marginal")):
        for r in p["top"]:
            slots = r.get(key) or []
            if layers and len(slots) >= layers:
                print_slots(r["name"] + what, slots, max(1, len(slots) // layers))
    g = p.get("gpu")
    if g:
        print(f"  GPU busy {g['busy_us_per_step'] / 1e3:.2f} ms, idle {g['idle_us_per_step'] / 1e3:.2f} ms a step "
              f"(span {g['span_us_per_step'] / 1e3:.2f} ms; {g['gaps_over_20us_per_step']:.0f} gaps over 20 us)")
        for gap in g["longest_gaps"]:
            print(f"    {gap['us']:.0f} us after {gap['after']} before {gap['before']}")


def gpu_timeline(prof, steps: int, top: int = 5) -> dict:
    """From a profile of `steps` engine steps: the GPU's busy time (the union of its kernels' and copies'
    intervals) against the span from the first to the last of them, per step, and the longest idle gaps with the
    activity on either side."""
    ivs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not ivs:
        return {}
    busy, gaps, cur_s, cur_e, prev = 0.0, [], ivs[0][0], ivs[0][1], ivs[0][2]
    for s, e, name in ivs[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, prev, name))
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
        if e >= cur_e:
            prev = name
    busy += cur_e - cur_s
    span = ivs[-1][1] - ivs[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {"span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (span - busy) / steps, "gaps_over_20us_per_step": sum(g[0] > 20 for g in gaps) / steps,
            "longest_gaps": [{"us": g, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]]}


def loop_floor(sizes: dict, ceil: dict, loop: dict) -> dict:
    """A decode loop's floor: a step of its mean running rows at their mean KV context (both counted from the
    scheduler before each timed step), against the loop's time a step."""
    rows = round(loop["rows_per_step"])
    f = floors(sizes, ceil, [(round(loop["mean_context"]), 1)] * rows, rows)
    return {"floor_ms": f["floor_ms"], "fraction_of_floor": f["floor_ms"] / loop["step_ms"],
            "serial_bound_ms": f["serial_bound_ms"], "fraction_of_serial_bound": f["serial_bound_ms"] / loop["step_ms"]}


LOOP_TEMPERATURE = [0.0]  # the loops' requests' temperature (--loop-temperature)


def time_decode_loop(core: EngineCore, batch: int, ctx: int, steps: int, warmup: int, async_on: bool,
                     rng: random.Random, profiled: bool = False, top: int = 20) -> dict:
    """Steady decoding of `batch` requests with ~`ctx` tokens of context through `EngineCore.step`; `profiled`:
    under the torch profiler, with the GPU's busy and idle time per step (gpu_timeline)."""
    core.set_async_scheduling(async_on)
    vocab = core.hf_config.vocab_size
    tag = f"loop-{'async' if async_on else 'sync'}-{batch}x{ctx}"
    rids = [f"{tag}-{i}" for i in range(batch)]
    # every request decodes through the timed steps: the first prompts start decoding while the last prefill
    # (batch * ctx / the step's token budget steps earlier), so they need that many more tokens
    prefill_steps = -(-batch * ctx // core.config.max_num_batched_tokens) + 2
    params = SamplingParams(max_tokens=min(core.max_model_len - ctx, steps + warmup + prefill_steps + 8),
                            temperature=LOOP_TEMPERATURE[0], ignore_eos=True)
    for rid in rids:
        core.add_request(rid, [rng.randrange(vocab) for _ in range(ctx)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token: decoding only from here
        started.update(o.request_id for o in core.step())
    for _ in range(warmup):
        core.step()
    collect = core.executor.collect
    waited = [0.0]

    def timed_collect(handle):
        t = time.perf_counter()
        try:
            return collect(handle)
        finally:
            waited[0] += time.perf_counter() - t

    core.executor.collect = timed_collect
    before = core.async_counts["overlapped"]
    prof = None
    if profiled:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU]
                       + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else []))
    sync(core.device)
    with prof if prof is not None else contextlib.nullcontext():
        t = time.perf_counter()
        tokens = rows = context = 0
        for _ in range(steps):
            running = core.scheduler.running
            rows += len(running)
            context += sum(r.num_computed_tokens for r in running)
            tokens += len(core.step())
        sync(core.device)
        wall = time.perf_counter() - t
    del core.executor.collect
    overlapped = core.async_counts["overlapped"] - before
    for rid in rids:
        core.abort_request(rid)
    while core.has_work():
        core.step()
    out = {"async": async_on, "step_ms": wall / steps * 1e3, "host_ms": (wall - waited[0]) / steps * 1e3,
           "collect_wait_ms": waited[0] / steps * 1e3, "overlapped_steps": overlapped, "steps": steps,
           "outputs_per_step": tokens / steps, "rows_per_step": rows / steps,
           "mean_context": context / max(rows, 1)}
    if prof is not None:
        out["gpu"] = gpu_timeline(prof, steps)
        out["profile"] = kernel_table(prof, steps, top)
    return out


# decode.py's switches an A/B turns from the command line: (flag, name in decode.py, bool or int, what it does)
DECODE_SWITCHES = [
    ("decode-fp8-v-widen", "FP8_V_WIDEN", bool,
     "an fp8 pool's V tiles widened to fp16 by inline PTX (through shared memory as fp16) in many-program launches"),
    ("decode-fp8-v-widen-few", "FP8_V_WIDEN_FEW", bool, "the same in the other launches (a few rows)"),
    ("decode-fp8-maxnreg", "FP8_MAXNREG", int, "the registers a thread of an fp8 pool's decode launch may hold"),
    ("decode-rope", "ROPE_IN_DECODE", bool,
     "decode-only steps leave the QK-norm, rotary and K/V write to the decode kernel"),
    ("decode-rope-fp8", "ROPE_IN_DECODE_FP8", bool,
     "with --decode-rope, fp8 pools too (on CUDA with --decode-fp8-v-widen-few)"),
    ("decode-rope-maxnreg", "ROPE_MAXNREG", int,
     "the registers a thread of the one-row decode tile may hold with the rotary in it (0: no limit)"),
]
# ... and pdserve.model.moe's
MOE_SWITCHES = [
    ("moe-sum-in-norm", "SUM_IN_NORM", bool, "a MoE layer leaves the sum over each token's experts to the next "
     "add+RMSNorm"),
    ("moe-router-skinny", "ROUTER_SKINNY", bool, "a sparse block's router product through pdserve.ops.linear (the "
     "skinny kernel for a few rows)"),
]
# ... and pdserve.ops.attention.library_prefill's
LIBRARY_SWITCHES = [
    ("library-fp8-pools", "FP8_POOLS", bool, "long prefill rows over an fp8 pool through cuDNN, the prefix "
     "dequantized as it is gathered"),
    ("library-strided-inputs", "STRIDED_INPUTS", bool, "cuDNN's inputs that need no padding as views of the step's "
     "fused q/k/v, not packed copies"),
]
SWITCHES = {"decode": DECODE_SWITCHES, "moe": MOE_SWITCHES,
            "library_prefill": LIBRARY_SWITCHES}  # by the module's short name in the help


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--decode", default="1x1024,256x1024,1x8192,32x8192", help="batch x context, comma-separated")
    ap.add_argument("--prefill", default="8192",
                    help="prompt lengths; NxL: N prompts of L in one step; C+N: a chunk of N after C cached tokens")
    ap.add_argument("--mixed", default="256x1024+512", help="decodes (batch x context) + prefill chunk")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true", help="capture no graphs at all")
    ap.add_argument("--compare-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="also time each case with the captured graphs switched off")
    ap.add_argument("--loop", default="1x1024,256x1024",
                    help="batch x context of steady decode loops through the engine, with and without async "
                         "scheduling, comma-separated (empty: none)")
    ap.add_argument("--loop-steps", type=int, default=100)
    ap.add_argument("--profile-loop", default="",
                    help="batch x context, comma-separated: the async decode loop again under the torch profiler, "
                         "with the GPU's busy and idle time per step and its longest idle gaps")
    ap.add_argument("--burst", default="", help="NxL: N prompts of L tokens at once, timed until every first token")
    ap.add_argument("--profile", default=None,
                    help="case names (e.g. decode:256x1024;prefill:8x1024), ';'-separated: profile them instead")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default="steps.json")
    ap.add_argument("--fill-kv", action="store_true",
                    help="fill the KV pool with random values first (it starts as zeros, which the per-step cases "
                         "read as their context)")
    ap.add_argument("--prefill-new-kv", action=argparse.BooleanOptionalAction, default=True,
                    help="Triton backend: prefill rows read their new tokens' K/V from the step's k/v (default) or, "
                         "with --no-prefill-new-kv, from the pool as before (an A/B in one lease)")
    ap.add_argument("--skinny", action=argparse.BooleanOptionalAction, default=True,
                    help="few-row linear products (decode graphs of 1..16 rows) through the skinny Triton kernel "
                         "(default) or, with --no-skinny, through cuBLAS (an A/B in one lease)")
    ap.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                    help="torch.backends.cuda.preferred_blas_library for the model's products (default: torch's): an "
                         "A/B in one lease")
    ap.add_argument("--pdl", choices=["early", "late", "off"], default="early",
                    help="programmatic dependent launch of the decode path's Triton kernels on sm_90+ "
                         "(pdserve.ops.pdl): the next kernel may launch at a kernel's start (early, the default), "
                         "after its wait (late), or not before it ends (off): an A/B in one lease")
    ap.add_argument("--decode-waves", type=int, default=None,
                    help="the decode kernel's split rule: programs for this many waves (pdserve default: "
                         "decode.DECODE_WAVES)")
    ap.add_argument("--min-split-keys", type=int, default=None,
                    help="the decode kernel's split rule: at least this many keys a split (default: "
                         "decode.MIN_SPLIT_KEYS)")
    ap.add_argument("--many-programs-tile", default=None,
                    help="the decode kernel's tile once rows x KV heads fill decode.MANY_PROGRAM_WAVES waves: "
                         "'keys,warps,stages', or 'none' (the table alone): an A/B in one lease")
    ap.add_argument("--many-programs-tile-fp8", default=None,
                    help="the same on an fp8 pool (decode.MANY_PROGRAMS_TILE_FP8, with the block table read a tile "
                         "ahead as MANY_PROGRAMS_PREFETCH says): 'keys,warps,stages', or 'none' (the table's fp8 "
                         "tiles at any number of programs): an A/B in one lease")
    ap.add_argument("--fold-norm", action=argparse.BooleanOptionalAction, default=True,
                    help="the add+RMSNorm folded into the one-row products around it (pdserve.ops.norm_fold); "
                         "--no-fold-norm: the norm's own kernel (an A/B)")
    ap.add_argument("--fold", action=argparse.BooleanOptionalAction, default=True,
                    help="the activation folded into one-row down projections (pdserve.ops.linear.set_fold); "
                         "--no-fold: its own kernel (an A/B)")
    ap.add_argument("--split-k", action=argparse.BooleanOptionalAction, default=True,
                    help="o/down split over K where the measured table says (pdserve.ops.split_k, the table shipped "
                         "for the GPU or PDSERVE_SPLIT_K_CONFIG's); --no-split-k: never (an A/B)")
    ap.add_argument("--loop-temperature", type=float, default=0.0,
                    help="the decode loops' temperature (1.0: what a request without one samples at, as vLLM's "
                         "bench serve sends them)")
    ap.add_argument("--sampler", choices=["auto", "torch"], default="auto",
                    help="torch: no one-pass sampling kernel (pdserve.ops.sampling), the torch path (an A/B)")
    ap.add_argument("--decode-prefetch", action=argparse.BooleanOptionalAction, default=True,
                    help="the many-program decode tile reads the block table a tile ahead (decode.MANY_PROGRAMS_"
                         "PREFETCH, tile (64, 4, 2)); --no-decode-prefetch: session 22's (64, 4, 3) without (an A/B)")
    for mod, switches in SWITCHES.items():
        for flag, name, kind, what in switches:
            ap.add_argument(f"--{flag}", default=None, help=f"{what} ({mod}.{name}; default: as shipped): an A/B",
                            **({"type": int} if kind is int else {"action": argparse.BooleanOptionalAction}))
    ap.add_argument("--few-rows-tile", default=None,
                    help="the decode kernel's tile below 8 rows on a 16-bit pool (decode.DECODE_TILES[(False, "
                         "False)]): 'keys,warps,stages' (an A/B)")
    ap.add_argument("--kv-write-early", action=argparse.BooleanOptionalAction, default=True,
                    help="the rotary kernel writes the step's K/V into the pool (TritonAttentionBackend."
                         "writes_kv_early); --no-kv-write-early: the backend's own write_kv kernel (an A/B)")
    ap.add_argument("--moe-route-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="a MoE layer's routing in one Triton launch (pdserve.ops.moe_route); --no-moe-route-kernel: "
                         "torch's softmax, top-k and renormalisation (an A/B)")
    ap.add_argument("--moe-align-one-program", action=argparse.BooleanOptionalAction, default=True,
                    help="moe_align in one program up to moe_align.ONE_PROGRAM_PAIRS routed rows; "
                         "--no-moe-align-one-program: its three kernels always (an A/B)")
    ap.add_argument("--ablate", default="",
                    help="an experiment, not a model: skip these kernels (wrong outputs, timings only), comma-"
                         "separated: norm (the layers' RMS norms return their input; the final one stays), act "
                         "(SiLU*mul returns the gate half), kv_write (nothing written to the pool). What fusing "
                         "them away could save at most")
    args = ap.parse_args(argv)
    LOOP_TEMPERATURE[0] = args.loop_temperature
    if args.sampler == "torch":
        from pdserve.engine import sampler as sampler_mod
        sampler_mod.use_fused = lambda x: False
    if args.ablate:
        ablate(args.ablate.split(","))
    from pdserve.ops.attention import decode as decode_mod
    if args.many_programs_tile:
        decode_mod.MANY_PROGRAMS_TILE = (None if args.many_programs_tile == "none"
                                         else tuple(int(x) for x in args.many_programs_tile.split(",")))
    if args.many_programs_tile_fp8:
        decode_mod.MANY_PROGRAMS_TILE_FP8 = (None if args.many_programs_tile_fp8 == "none"
                                             else tuple(int(x) for x in args.many_programs_tile_fp8.split(",")))
    if not args.decode_prefetch:
        decode_mod.MANY_PROGRAMS_PREFETCH = False
        decode_mod.MANY_PROGRAMS_TILE = (64, 4, 3)
    from pdserve.model import moe as moe_mod
    from pdserve.ops.attention import library_prefill as library_mod
    modules = {"decode": decode_mod, "moe": moe_mod, "library_prefill": library_mod}
    for mod, switches in SWITCHES.items():
        for flag, name, _, _ in switches:
            value = getattr(args, flag.replace("-", "_"))
            if value is not None:  # an A/B of a module's switch; None: as shipped
                setattr(modules[mod], name, value)
    if args.few_rows_tile:
        decode_mod.DECODE_TILES[(False, False)] = tuple(int(x) for x in args.few_rows_tile.split(","))
    if args.decode_waves:
        decode_mod.DECODE_WAVES = args.decode_waves
    if args.min_split_keys:
        decode_mod.MIN_SPLIT_KEYS = args.min_split_keys
    from pdserve.ops.pdl import set_pdl
    set_pdl(args.pdl)
    if args.blas:
        import torch
        torch.backends.cuda.preferred_blas_library(args.blas)
    if not args.skinny:
        from pdserve.ops.linear import set_skinny
        set_skinny(False)
    if not args.fold:
        from pdserve.ops.linear import set_fold
        set_fold(False)
    if not args.fold_norm:
        from pdserve.ops.norm_fold import set_norm_fold
        set_norm_fold(False)
    if not args.split_k:
        from pdserve.ops.split_k import set_split_k
        set_split_k(False)
    if not args.moe_route_kernel:
        from pdserve.model import moe
        moe.TRITON_ROUTING.clear()
    if not args.moe_align_one_program:
        from pdserve.ops import moe_align
        moe_align.ONE_PROGRAM_PAIRS = -1
    if not args.kv_write_early:
        from pdserve.ops.attention.triton_backend import TritonAttentionBackend
        TritonAttentionBackend.writes_kv_early = False
    if not args.prefill_new_kv:
        from pdserve.ops.attention.triton_backend import TritonAttentionBackend
        TritonAttentionBackend.read_new_kv = False

    rec = new_record("engine_steps", vars(args))
    cfg = EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                       kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                       max_num_seqs=512, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                       enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    core = EngineCore(cfg)
    if args.fill_kv:  # the pool starts as zeros; the per-step cases read whatever it holds (the loops write theirs)
        torch.manual_seed(0)
        core.runner.kv_cache.view(torch.uint8).random_(0, 256) if core.runner.kv_dtype.itemsize == 1 \
            else core.runner.kv_cache.normal_(0.0, 1.0)
        sync(core.device)
    rec["ceilings"] = ceil = ceilings(core.device)
    print("ceilings:", ceil, flush=True)
    sizes = model_sizes(core)
    runner = core.runner
    rec["engine"] = {"num_blocks": core.kv.pool.num_blocks, "backend": runner.backend.name, "dtype": str(core.dtype),
                     "kv_dtype": str(runner.kv_dtype), "block_bytes": core.block_bytes, **sizes,
                     "decode_graph_sizes": runner.decode_sizes, "mixed_graph_sizes": runner.mixed_sizes}
    rng = random.Random(0)
    cases = parse_cases(args.decode, args.prefill, args.mixed)
    if args.profile:
        rec["profiles"] = []
        for case in args.profile.split(";"):
            kind, _, spec = case.partition(":")
            if kind not in ("decode", "prefill", "mixed"):
                ap.error("--profile takes decode:BxCTX, prefill:[Nx]L or mixed:BxCTX+[Nx]L, ';'-separated")
            name, seqs = parse_cases(**{kind: spec})[0]
            batch = build_batch(core, name, seqs, rng)
            if batch is None:
                print(f"{name}: does not fit the KV pool", file=sys.stderr)
                return 1
            prof = {"case": name, "graphs": profile_case(core, batch, args.profile_steps, args.top)}
            print_profile(f"{name} ({'graphs' if runner.decode_sizes or runner.mixed_sizes else 'eager'})",
                          prof["graphs"])
            if args.compare_eager and (runner.decode_sizes or runner.mixed_sizes):
                runner.use_graphs = False
                prof["eager"] = profile_case(core, batch, args.profile_steps, args.top)
                runner.use_graphs = True
                print_profile(f"{name} (eager)", prof["eager"])
            for req in batch.requests:
                core.kv.free(req)
            rec["profiles"].append(prof)
        save_json(rec, args.out)
        return 0

    results = []
    for name, seqs in cases:
        batch = build_batch(core, name, seqs, rng)
        if batch is None:
            print(f"{name}: skipped, does not fit the KV pool ({core.kv.pool.num_blocks} blocks)", flush=True)
            results.append({"case": name, "skipped": "does not fit the KV pool"})
            continue
        r = {"case": name, **floors(sizes, ceil, [(c, n) for c, n, _ in seqs], sum(s for *_, s in seqs))}
        r.update(time_case(core, batch, args.iters, args.warmup))
        r["fraction_of_floor"] = r["floor_ms"] / r["step_ms_median"]
        r["fraction_of_serial_bound"] = r["serial_bound_ms"] / r["step_ms_median"]
        if args.compare_eager and (runner.decode_sizes or runner.mixed_sizes):
            runner.use_graphs = False
            r["eager"] = time_case(core, batch, args.iters, args.warmup)
            runner.use_graphs = True
        if r["path"] == "decode_graph" and runner.mixed_sizes and len(seqs) <= runner.mixed_sizes[-1]:
            runner.use_full_decode_graphs = False  # the same decode step through piecewise graphs
            r["piecewise"] = time_case(core, batch, args.iters, args.warmup)
            runner.use_full_decode_graphs = True
        for req in batch.requests:
            core.kv.free(req)
        results.append(r)
        eager = f", eager {r['eager']['step_ms_median']:.2f} ms" if "eager" in r else ""
        eager += f", piecewise {r['piecewise']['step_ms_median']:.2f} ms" if "piecewise" in r else ""
        print(f"{name}: {r['step_ms_median']:.2f} ms ({r['path']}; floor {r['floor_ms']:.2f} ms {r['bound']}, "
              f"{r['fraction_of_floor']:.0%}; serial bound {r['serial_bound_ms']:.2f} ms, "
              f"{r['fraction_of_serial_bound']:.0%}){eager}", flush=True)
    rec["results"] = results
    rec["loops"] = loops = []
    for spec in filter(None, args.loop.split(",")):
        b, ctx = (int(x) for x in spec.split("x"))
        for async_on in (False, True):
            r = {"case": f"loop:{spec}", **time_decode_loop(core, b, ctx, args.loop_steps, args.warmup, async_on,
                                                             rng)}
            r.update(loop_floor(sizes, ceil, r))
            loops.append(r)
            print(f"{r['case']} async {'on ' if async_on else 'off'}: {r['step_ms']:.2f} ms/step (host "
                  f"{r['host_ms']:.2f} ms, waiting for tokens {r['collect_wait_ms']:.2f} ms; "
                  f"{r['overlapped_steps']} of {r['steps']} steps overlapped; {r['rows_per_step']:.1f} rows and "
                  f"{r['outputs_per_step']:.1f} outputs a step at {r['mean_context']:.0f} tokens of context; floor "
                  f"{r['floor_ms']:.2f} ms, {r['fraction_of_floor']:.0%}; serial bound {r['serial_bound_ms']:.2f} ms, "
                  f"{r['fraction_of_serial_bound']:.0%})", flush=True)
    for spec in filter(None, args.profile_loop.split(",")):
        b, ctx = (int(x) for x in spec.split("x"))
        r = {"case": f"loop:{spec}", **time_decode_loop(core, b, ctx, args.loop_steps, args.warmup, True, rng,
                                                         profiled=True, top=args.top)}
        r["profile"]["layers"] = core.hf_config.num_hidden_layers  # print_profile folds per-layer kernels by kind
        loops.append(r)
        g = r.get("gpu", {})
        print(f"{r['case']} async on, profiled: {r['step_ms']:.2f} ms/step; GPU busy "
              f"{g.get('busy_us_per_step', 0) / 1e3:.2f} ms and idle {g.get('idle_us_per_step', 0) / 1e3:.2f} ms a "
              f"step ({g.get('gaps_over_20us_per_step', 0):.1f} gaps over 20 us a step)", flush=True)
        for gap in g.get("longest_gaps", []):
            print(f"  idle {gap['us']:.0f} us after {gap['after']} before {gap['before']}", flush=True)
        print_profile(f"{r['case']} async ({r['outputs_per_step']:.1f} outputs a step)", r["profile"])
    rec["bursts"] = bursts = []
    for spec in filter(None, args.burst.split(",")):
        n, length = (int(x) for x in spec.split("x"))
        r = time_burst(core, n, length, rng)
        bursts.append(r)
        st = sorted(r["step_ms"])
        print(f"{r['case']}: every first token after {r['wall_s']:.2f} s ({r['prefill_tok_s']:.0f} prompt tokens/s, "
              f"{r['steps']} steps, step ms median {st[len(st) // 2]:.1f} max {st[-1]:.1f}; TTFT mean "
              f"{r['ttft_mean_s']:.2f} s p90 {r['ttft_p90_s']:.2f} s)", flush=True)
    save_json(rec, args.out)
    print("\n| step | tokens | ms (median) | p90 | path | floor ms | bound | floor/measured | eager ms | "
          "piecewise ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['case']} | skipped: {r['skipped']} ||||||||")
            continue
        eager = f"{r['eager']['step_ms_median']:.2f}" if "eager" in r else "-"
        pw = f"{r['piecewise']['step_ms_median']:.2f}" if "piecewise" in r else "-"
        print(f"| {r['case']} | {r['tokens']} | {r['step_ms_median']:.2f} | {r['step_ms_p90']:.2f} | {r['path']} | "
              f"{r['floor_ms']:.2f} | {r['bound']} | {r['fraction_of_floor']:.1%} | {eager} | {pw} |")
    if loops:
        print("\n| decode loop | async | ms/step | host ms/step | waiting for tokens ms/step | steps overlapped |")
        print("|---|---|---|---|---|---|")
        for r in loops:
            print(f"| {r['case']} | {'on' if r['async'] else 'off'} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
                  f"{r['collect_wait_ms']:.2f} | {r['overlapped_steps']}/{r['steps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

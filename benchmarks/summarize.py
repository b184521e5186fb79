"""Print the markdown tables of docs/benchmarks.md from the recorded JSON results (so no number there is typed
by hand):  python benchmarks/summarize.py > /tmp/tables.md"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

B = Path(__file__).parent


def load(rel: str) -> dict:
    p = B / rel
    if p.suffix == ".gz":
        return json.loads(gzip.decompress(p.read_bytes()))
    return json.loads(p.read_text())


def engine() -> None:
    e = load("engine/results/engine_qwen3-8b.json")
    c = e["ceilings"]
    print(f"Engine, dummy qwen3-8b (bf16), {c['gpu']}, commit {e['git_commit']}, `{e['command']}`. Ceilings measured "
          f"in the same run: HBM copy {c['hbm_copy_gbps'] / 1000:.2f} TB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} "
          "TFLOP/s. Backend: " + e["engine"]["backend"] + ", decode steps replayed as CUDA graphs.\n")
    print("| prefill | tokens/s | TFLOP/s | of matmul ceiling |\n|---|---|---|---|")
    for r in e["results"]["prefill"]:
        print(f"| {r['n_seqs']} x {r['prompt_len']} tokens | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
              f"{r['fraction_of_matmul_ceiling']:.0%} |")
    print("\n| decode batch (context 1024) | step ms (median) | floor ms (weights + KV at HBM copy rate) | "
          "of HBM ceiling |\n|---|---|---|---|")
    for r in e["results"]["decode"]:
        print(f"| {r['batch']} | {r['step_ms_median']:.2f} | {r['floor_ms']:.2f} | {r['fraction_of_hbm_ceiling']:.0%} |")


def transfer() -> None:
    print("\n| transfer (8192 tokens of qwen3-8b KV, 512 random 16-token blocks, 1.21 GB) | op | median ms | p99 ms | "
          "GB/s | peer-copy ceiling GB/s (same run) | of ceiling |\n|---|---|---|---|---|---|---|")
    rows = [("pdserve cuda_ipc, 4 streams (default)", "cuda_ipc_streams4.json"),
            ("pdserve cuda_ipc, 2 streams", "cuda_ipc_streams2.json"),
            ("pdserve cuda_ipc, 1 stream", "cuda_ipc_streams1.json"),
            ("pdserve cuda_ipc, one copy per block", "cuda_ipc_percopy.json"),
            ("NIXL 1.5.1 (UCX) through the same agent", "nixl.json"),
            ("pdserve tcp (GPU memory staged)", "tcp_gpu.json")]
    for name, f in rows:
        t = load(f"transfer/results_2xh200/{f}")
        for op in ("write", "read"):
            r = t["results"].get(op)
            if not r:
                continue
            ceil = r.get("ceiling_GBps")
            print(f"| {name} | {op} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['GBps']:.1f} | "
                  f"{ceil:.1f} | {r.get('fraction_of_ceiling', float('nan')):.0%} |" if ceil else
                  f"| {name} | {op} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['GBps']:.1f} | - | - |")
    print("\n| single 16-token block (2.25 MiB) | median us, call -> receiver notified | p99 us |\n|---|---|---|")
    for name, f in rows[:1] + rows[4:5]:
        r = load(f"transfer/results_2xh200/{f}")["results"]["single_block_write"]
        print(f"| {name} | {r['e2e_median_us']:.0f} | {r['e2e_p99_us']:.0f} |")
    t = load("transfer/results_cpu/tcp_cpu.json")
    print("\n| tcp on CPU (this 2-core VM) | op | GB/s | raw socket stream GB/s (same processes, same run) | ratio |"
          "\n|---|---|---|---|---|")
    for op in ("write", "read"):
        r = t["results"][op]
        print(f"| pdserve tcp | {op} | {r['GBps']:.2f} | {r['ceiling_GBps']:.2f} | {r['GBps'] / r['ceiling_GBps']:.0%} |")


def handover() -> None:
    p = load("router/results_2xh200/pd_handover.json")
    print("\n| prompt tokens | handover p50 / p99 ms (prefill done -> KV landed, decode admitted) | prefill p50 ms | "
          "TTFT via router p50 / p99 ms | TTFT prefill instance alone p50 / p99 ms | router - alone p50 ms |"
          "\n|---|---|---|---|---|---|")
    for n, r in p["results"].items():
        h, pr, tr, ta = r["handover_s"], r["prefill_s"], r["ttft_router_s"], r["ttft_prefill_alone_s"]
        print(f"| {n} | {h['p50'] * 1e3:.1f} / {h['p99'] * 1e3:.1f} | {pr['p50'] * 1e3:.1f} | "
              f"{tr['p50'] * 1e3:.1f} / {tr['p99'] * 1e3:.1f} | {ta['p50'] * 1e3:.1f} / {ta['p99'] * 1e3:.1f} | "
              f"{(tr['p50'] - ta['p50']) * 1e3:+.1f} |")


def server() -> None:
    d = load("server/results/decode_step_qwen3-8b.json")
    print(f"\n| decode step, {d['args']['batch']} concurrent streams, dummy qwen3-8b, {d['gpu']} | ms |\n|---|---|")
    print(f"| engine alone (inline, no server) | {d['engine']['step_s_median'] * 1e3:.2f} |")
    print(f"| as seen by the clients through the server | {d['server']['client_step_s'] * 1e3:.2f} |")
    print(f"| engine process inside the server | {d['server']['engine_step_in_server_s'] * 1e3:.2f} |")
    print(f"| ratio client / engine (target <= {d['target_ratio']}) | {d['ratio_client_over_engine']:.3f} |")


def search() -> None:
    for label, f in (("steady (30 x rate requests per trial, at most 30 s of arrivals)",
                      "serve/results_h200/search_steady.json.gz"),
                     ("short (5 x rate requests per trial, at most 15 s of arrivals)",
                      "serve/results_h200/burst_search.json.gz")):
        s = load(f)
        se = s["searches"][0]
        print(f"\nSLO search `{se['slo']}`, {label}, commit {s['git_commit']}: `{s['command']}`\n")
        print("| rate req/s | sent | result | p90 TTFT ms | p90 TPOT ms | output tok/s | goodput req/s |"
              "\n|---|---|---|---|---|---|---|")
        for t in se["trials"]:
            run = s["runs"][t["run_index"]]
            m = run["metrics"]
            vals = list(t["values"].values())
            print(f"| {t['rate']:g} | {run['num_sent']} | {'pass' if t['passed'] else 'FAIL'} | {_fmt(vals[0])} | "
                  f"{_fmt(vals[1])} | {_fmt(m.get('output_throughput'))} | {_fmt(t.get('goodput'))} |")
        print(f"\nmaximum rate meeting the SLO: **{se['max_rate']:g} req/s** (first failing rate {se['min_failed_rate']:g}); "
              f"goodput at that rate {se['goodput']:.2f} req/s")


def vs_vllm() -> None:
    c = load("vs_vllm/results_2xh200/comparison.json")
    print(f"vLLM 0.22 on GPU 0 and pdserve on GPU 1 of one 2xH200 lease, at the same time, both measured by vLLM's "
          f"`bench serve` (`benchmarks/vs_vllm/side_by_side.sh single`), dummy Qwen3-8B bf16, {c['date'][:10]}; "
          "the tree was commit a1b214a (the file's `commit` field, read from the device copy's stale git metadata, "
          "is wrong). pdserve ran with async scheduling (its CUDA default).\n")
    _side_by_side(c)
    a = load("engine/results_2xh200/async_check.json")
    print(f"\nAsync scheduling on vs off, same engine and requests (`benchmarks/engine/async_check.py`, H200, tree "
          "of commit 88625d9, 512-token prompts, 64 output tokens): greedy tokens identical for "
          f"{a['identical_requests']}/{a['requests']} requests (random weights: near-tied logits flip under different "
          "batch compositions); steady decode:")
    for key in a["on"]:
        if key.startswith("batch_"):
            on, off = a["on"][key], a["off"][key]
            print(f"- {key.replace('_', ' ')}: {on['ms_per_step']:.2f} ms/step async vs {off['ms_per_step']:.2f} sync "
                  f"({off['ms_per_step'] / on['ms_per_step']:.3f}x)")


def kernels_s3() -> None:
    sw = load("attention/results_h200/decode_sweep_fp16dot.json")
    rows = [r for r in sw["rows"] if "us" in r]
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    print("Paged decode attention, dummy Qwen3-8B heads (32 q, 8 KV, dim 128), head-major pool, H200, fraction of the "
          "HBM floor measured in the same run (`benchmarks/attention/sweep_decode.py`), with the tile the engine picks "
          "now (128-key tiles, 3 stages, from 8 rows; 64-key below):\n")
    print("| pool | " + " | ".join(f"{b} x {c}" for b, c in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for kv in ("bf16", "fp8"):
        cells = []
        for b, c in shapes:
            want = [128, 4, 3] if b >= 8 else ([64, 4, 2] if kv == "bf16" else [64, 4, 3])
            hit = [r for r in rows if r["kv"] == kv and (r["batch"], r["context"]) == (b, c) and list(r["tile"]) == want]
            cells.append(f"{100 * hit[0]['of_floor']:.0f} %" if hit else "-")
        print(f"| {kv} | " + " | ".join(cells) + " |")
    t = load("transfer/results_2xh200_s3/transfer_cuda_ipc.json")
    w, r = t["results"]["write"], t["results"]["read"]
    print(f"\nKV transfer, cuda_ipc between the two GPUs, 8192 tokens of Qwen3-8B KV in 512 random 16-token blocks "
          f"({w['bytes'] / 1e9:.2f} GB): write {w['median_ms']:.2f} ms ({100 * w['fraction_of_ceiling']:.0f} % of the "
          f"peer-copy ceiling of the same run), read {r['median_ms']:.2f} ms "
          f"({100 * r['fraction_of_ceiling']:.0f} %); `benchmarks/transfer/results_2xh200_s3/`.")


PD_RUNS = (("all GPUs visible", "pd_handover"), ("CUDA_VISIBLE_DEVICES per instance", "pd_handover_isolated"),
           ("fp8 KV cache", "pd_handover_fp8"))  # lease_2xh200.sh verify_pd's three runs (label, file)


def _pytest_verdict(rel: str) -> str:
    """A pytest log's summary ("N passed, ..."), or why there is none."""
    import re

    text = (B / rel).read_text()
    m = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", text, re.M)
    if m:
        return m[-1]
    return "no verdict: interrupted at the time limit" if "KeyboardInterrupt" in text else "no summary"


def session4() -> None:
    """The session-4 lease (benchmarks/lease_2xh200.sh verify_xfer / verify_pd) and GPU test round 4."""

    for part in ("ops", "rest"):
        print(f"- GPU tests on one H200, `{part}`: {_pytest_verdict(f'gpu_tests/round4/{part}/gpu_tests/gpu_tests.txt')}")
    base = "lease_s4/verify_xfer/verify_xfer/transfer"
    t = load(f"{base}/all_transports.json")
    print("\nEvery transport in one run (`bench transfer --transport all`, 2xH200, 8192 tokens of Qwen3-8B KV in 512 "
          "random 16-token blocks, peer-copy ceiling of the same run):\n")
    print("| transport | write ms | read ms | write GB/s | of ceiling | one block, call -> notified us |\n|---|---|---|---|---|---|")
    for tr in ("cuda_ipc", "nixl", "nccl", "mooncake", "tcp"):
        w, r = t["results"].get(f"write:{tr}"), t["results"].get(f"read:{tr}")
        sb = t["results"].get(f"single_block_write:{tr}") or {}
        if w and r:
            print(f"| {tr} | {w['median_ms']:.2f} | {r['median_ms']:.2f} | {w['GBps']:.1f} | "
                  f"{100 * w['fraction_of_ceiling']:.0f} % | {_fmt(sb.get('e2e_median_us'))} |")
    for name in ("cuda_ipc_isolated_vmm", "nccl_isolated"):
        x = load(f"{base}/{name}.json")["results"]["write"]
        print(f"\n- {name} (each process sees only its own GPU): write {x['median_ms']:.2f} ms "
              f"({100 * x['fraction_of_ceiling']:.0f} % of the ceiling)", end="")
    mc = load(f"{base}/nccl_memcheck.json")["memcheck"]
    grew = ", ".join(f"{k} +{v['grew_bytes'] / 2**20:.1f} MiB" for k, v in mc["sides"].items())
    print(f"\n- nccl memory check, {mc['transfers_in_flight']} transfers of {mc['bytes_per_transfer'] / 2**20:.0f} MiB "
          f"in flight: {grew} beyond the pools")
    text = (B / f"{base}/nixl_anchor.txt").read_text()
    anchor = json.loads(text[text.find("{"):])
    for op in ("write", "read"):
        ours = t["results"][f"{op}:nixl"]["median_ms"]
        ref = anchor[f"nixl_block_major_{op.upper()}_ms"]
        print(f"- NIXL {op} via pdserve's agent {ours:.2f} ms vs NIXL's own block-major run {ref:.2f} ms "
              f"({ours / ref:.2f}x; target <= 1.10x)")
    print("\n1P1D through the router (`benchmarks/router/pd_handover.py`, `pdserve serve --prefill 1 --decode 1`, "
          "dummy Qwen3-8B, 2xH200):\n")
    print("| run | prompt tokens | handover p50 ms | TTFT router p50 ms | TTFT prefill alone p50 ms | router - alone ms |"
          "\n|---|---|---|---|---|---|")
    for label, f in PD_RUNS:
        d = load(f"lease_s4/verify_pd/verify_pd/{f}.json")
        for n, r in d["results"].items():
            h, tr, ta = r["handover_s"]["p50"], r["ttft_router_s"]["p50"], r["ttft_prefill_alone_s"]["p50"]
            print(f"| {label} | {n} | {h * 1e3:.2f} | {tr * 1e3:.1f} | {ta * 1e3:.1f} | {(tr - ta) * 1e3:+.1f} |")


def session5() -> None:
    """The session-5 lease (2xH200): TP=2 side by side with both clients, the MoE fp8 run, TP step times."""
    import re

    base = "lease_s5"
    c = load(f"{base}/tp_sbs/comparison.json")
    print("TP=2 side by side (`benchmarks/lease_2xh200.sh tp_sbs`: vLLM 0.22 `-tp 2`, then pdserve `-tp 2`, on the same "
          "two H200s one after the other; dummy Qwen3-8B bf16; vLLM's `bench serve` first on each server):\n")
    _side_by_side(c)
    print("\nThe same server and workload measured by vLLM's client, then at once by pdserve's (`pdserve bench serve`, "
          "same dataset arguments):\n")
    print("| server, workload | out tok/s (pdserve's / vLLM's client) | mean TTFT | mean TPOT |\n|---|---|---|---|")
    for r in c["clients"]:
        q = r["ratio"]
        print(f"| {r['run']} | {q['output_throughput']:.3f} | {q['mean_ttft_ms']:.3f} | {q['mean_tpot_ms']:.3f} |")
    text = (B / f"{base}/tp_tests/bench_tp.txt").read_text()
    steps = re.findall(r"^TP=(\d+) batch (\d+): ([\d.]+) ms \((\w+)\)", text, re.M)
    print("\nDecode step at TP=1 and TP=2 (`benchmarks/engine/bench_tp.py`, dummy Qwen3-8B, 1024 tokens of context per "
          "sequence, CUDA graphs; the run's time limit ended it before its all-reduce and eager rows):\n")
    print("| batch | TP=1 ms | TP=2 ms | TP=2 / TP=1 |\n|---|---|---|---|")
    got = {(int(tp), int(b)): float(ms) for tp, b, ms, _ in steps}
    for b in sorted({b for _, b in got}):
        if (1, b) in got and (2, b) in got:
            print(f"| {b} | {got[(1, b)]:.2f} | {got[(2, b)]:.2f} | {got[(2, b)] / got[(1, b)]:.2f} |")
    v = load(f"{base}/moe/vllm_single_1024x1024_c256.json")
    p = load(f"{base}/moe2/pdserve_single_1024x1024_c256.json")
    vs = load(f"{base}/moe/vllm_single_server.json")
    log = gzip.decompress((B / f"{base}/moe2/pdserve.log.gz").read_bytes()).decode()
    blocks, size = map(int, re.findall(r"(\d+) KV blocks of (\d+) tokens", log)[-1])
    print("\nDummy Qwen3-30B-A3B, `--kv-cache-dtype fp8` on both, 1024/1024 at concurrency 256, vLLM's client, one H200 "
          "each in one lease (vLLM with FLASH_ATTN on GPU 0; pdserve on GPU 1 after vLLM's run, because its first "
          "start in that call failed on the staging command's interpreter):\n")
    print("| | vLLM | pdserve | pdserve / vLLM |\n|---|---|---|---|")
    for k, label in (("output_throughput", "out tok/s"), ("mean_ttft_ms", "mean TTFT ms"),
                     ("mean_tpot_ms", "mean TPOT ms"), ("p99_ttft_ms", "p99 TTFT ms")):
        print(f"| {label} | {_fmt(v[k])} | {_fmt(p[k])} | {p[k] / v[k]:.2f} |")
    print(f"| KV tokens | {vs['kv_tokens']:,} | {blocks * size:,} | {blocks * size / vs['kv_tokens']:.3f} |")
    v8 = load(f"{base}/moe/vllm_single_8192x16_c1.json")
    print(f"\nvLLM alone, 8192/16 one at a time: TTFT {v8['mean_ttft_ms']:.1f} ms, TPOT {v8['mean_tpot_ms']:.2f} ms "
          "(pdserve's run of it did not fit the device time left).")


def session7() -> None:
    """The session-7 lease (one H200): side by side twice, the engine's steps and burst, the server's burst by wave."""
    base = "lease_s7"
    print("Side by side (`benchmarks/lease_1gpu.sh sbs`: vLLM 0.22, then pdserve, on one H200; dummy Qwen3-8B bf16; "
          "vLLM's `bench serve`):\n")
    _side_by_side(load(f"{base}/sbs/comparison.json"))
    c2 = load(f"{base}/sbs2/comparison.json")
    w = {x["workload"]: x for x in c2["workloads"]}["1024x1024_c256"]
    print(f"\nAgain on a fresh machine of the same kind with the pipe writer (e0b640e): 1024/1024 c256 "
          f"{_fmt(w['vllm']['output_throughput'])} vs {_fmt(w['pdserve']['output_throughput'])} tok/s "
          f"({w['ratio']['output_throughput']:.2f}), mean TTFT {_fmt(w['vllm']['mean_ttft_ms'])} vs "
          f"{_fmt(w['pdserve']['mean_ttft_ms'])} ms.")
    v = load(f"{base}/sbs/vllm_single_1024x1024_c256.json")
    pd = load(f"{base}/sbs/pdserve_single_1024x1024_c256.json")
    print("\nThe 1024/1024 c256 run in detail (vLLM / pdserve): " + ", ".join(
        f"{k} {_fmt(v[k])} / {_fmt(pd[k])}" for k in ("p50_itl_ms", "p90_itl_ms", "max_output_tokens_per_s",
                                                       "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms")) + ".")
    st = load(f"{base}/steps/steps.json")
    print("\nEngine steps against their floors (`bench_steps.py`, same run's ceilings: HBM "
          f"{st['ceilings']['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {st['ceilings']['bf16_matmul_tflops']:.0f} "
          "TFLOP/s):\n")
    print("| step | ms | floor ms | floor / measured | path |\n|---|---|---|---|---|")
    for r in st["results"]:
        print(f"| {r['case']} | {r['step_ms_median']:.2f} | {r['floor_ms']:.2f} | {r['fraction_of_floor']:.1%} | "
              f"{r['path']} |")
    for b in st["bursts"]:
        print(f"\n{b['case']} through `EngineCore.step`: every first token after {b['wall_s']:.2f} s "
              f"({b['prefill_tok_s']:,.0f} prompt tokens/s, {b['steps']} steps), TTFT mean {b['ttft_mean_s']:.2f} s, "
              f"p90 {b['ttft_p90_s']:.2f} s.")
    print("\nThe same burst through the server (`lease_1gpu.sh serve_tl`, `pdserve bench serve`, TTFT by wave):\n")
    print("| run | wave | requests | TTFT mean s | p90 s | max s |\n|---|---|---|---|---|---|")
    for run in ("1024x1024", "1024x16"):
        for name, k, mean, p90, mx in _waves(f"{base}/serve_tl/c256_{run}.requests.json"):
            print(f"| {run} | {name} | {k} | {mean:.2f} | {p90:.2f} | {mx:.2f} |")


def _compiles(rel: str) -> str:
    """Kernels a server's log says it compiled after its warm-up (pdserve.ops.jit_watch's warnings), with the
    seconds they took."""
    import gzip
    import re
    with gzip.open(B / rel, "rt", errors="replace") as f:
        secs = [float(m.group(1)) for line in f if (m := re.search(r"compiled a kernel while serving \(([0-9.]+) s", line))]
    return f"{len(secs)} ({sum(secs):.2f} s)" if secs else "0"


def _waves(rel: str) -> list[tuple[str, int, float, float, float]]:
    import sys as _sys
    _sys.path.insert(0, str(B / "server"))
    from serve_timeline import request_rows
    rows = sorted((r for r in request_rows(load(rel)) if r.get("ttft") is not None), key=lambda r: r["start"])
    out = []
    for name, part in (("first 256", rows[:256]), ("the rest", rows[256:])):
        t = sorted(r["ttft"] for r in part)
        if t:
            out.append((name, len(t), sum(t) / len(t), t[int(0.9 * len(t))], t[-1]))
    return out


def session8() -> None:
    """The session-8 lease (one H200): compiles while serving found and removed; side by side dense and MoE."""
    base = "lease_s8"
    print("The same server and load three times (`lease_1gpu.sh serve_tl`: dummy Qwen3-8B, `pdserve bench serve` "
          "1024/1024 then 1024/16, 512 prompts at concurrency 256), TTFT by wave and the kernels the server logged as "
          "compiled after its warm-up:\n")
    print("| code | run | wave | requests | TTFT mean s | p90 s | max s | compiled while serving |\n"
          "|---|---|---|---|---|---|---|---|")
    for d, what in (("serve_tl_before", "start of session"), ("serve_tl_named", "merge tile fixed, compiles named"),
                    ("serve_tl_after", "aligned metadata + warm-up groups")):
        n = _compiles(f"{base}/{d}/server.log.gz")
        for run in ("1024x1024", "1024x16"):
            for name, k, mean, p90, mx in _waves(f"{base}/{d}/c256_{run}.requests.json"):
                print(f"| {what} | {run} | {name} | {k} | {mean:.2f} | {p90:.2f} | {mx:.2f} | {n} |")
    print("\nSide by side (`lease_1gpu.sh sbs`: vLLM 0.22, then pdserve, on one H200; dummy Qwen3-8B bf16; vLLM's "
          "`bench serve`), metadata aligned (before the warm-up groups; "
          f"kernels compiled while serving: {_compiles(f'{base}/sbs/pdserve.log.gz')}):\n")
    _side_by_side(load(f"{base}/sbs/comparison.json"))
    print("\nInter-token latency beside TPOT (vLLM / pdserve, ms):\n")
    print("| workload | mean TPOT | mean ITL | p50 ITL | p90 TTFT | mean end-to-end |\n|---|---|---|---|---|---|")
    for w in ("1024x1024_c256", "8192x16_c1", "32768x16_c1"):
        v, pd = load(f"{base}/sbs/vllm_single_{w}.json"), load(f"{base}/sbs/pdserve_single_{w}.json")
        print(f"| {w} | " + " | ".join(f"{_fmt(v[k]) if v[k] >= 100 else f'{v[k]:.2f}'} / "
                                       f"{_fmt(pd[k]) if pd[k] >= 100 else f'{pd[k]:.2f}'}"
                                       for k in ("mean_tpot_ms", "mean_itl_ms", "p50_itl_ms", "p90_ttft_ms",
                                                 "mean_e2el_ms")) + " |")
    print("\nQwen3-30B-A3B (dummy weights, bf16, fp8 KV cache) on the same H200 right after "
          f"(kernels compiled while serving: {_compiles(f'{base}/moe1/pdserve.log.gz')}; vLLM with "
          "`--kv-cache-dtype fp8 --attention-backend FLASH_ATTN`):\n")
    _side_by_side(load(f"{base}/moe1/comparison.json"))


def _chunks(rel: str) -> tuple[float, float, float]:
    """(mean chunks a request's stream carried, mean TTFT of the requests after the first, median inter-chunk
    gap ms) from a --save-detailed result: the first request is a prefix hit of the client's warm-up prompts."""
    d = load(rel)
    itls = [x for r in d["itls"] for x in r]
    gaps = sorted(itls)
    return (sum(len(r) + 1 for r in d["itls"]) / len(d["itls"]), 1e3 * sum(d["ttfts"][1:]) / (len(d["ttfts"]) - 1),
            1e3 * gaps[len(gaps) // 2])


def session9() -> None:
    """The session-9 lease (one H200): prefill tile sweep, KV sizing as vLLM counts it, clients on one server."""
    base = "lease_s9"
    a = load(f"{base}/attn/attention.json")
    c = a["ceilings"]
    print(f"Prefill attention alone (`bench_attention.py --sweep`, bf16 pool, 32 q / 8 KV heads, d=128; {c['gpu']}: "
          f"bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s measured in the same run). TFLOP/s by tile choice:\n")
    shapes = ["prompt 8192", "prompt 32768", "chunk 512 on 8192"]
    print("| block_m x block_n, g_pack, warps, stages | " + " | ".join(shapes) + " |\n|---|---|---|---|")
    by: dict[tuple, dict] = {}
    for r in a["sweep"]:
        if "us" in r:
            k = r["config"]
            by.setdefault((k["block_m"], k["block_n"], k["g_pack"], k["num_warps"], k["num_stages"]), {})[
                r["shape"]] = (r["tflops"], r["default"])
    for k, v in sorted(by.items(), key=lambda kv: -kv[1].get("prompt 32768", (0, 0))[0]):
        mark = " (default before)" if any(d for _, d in v.values()) else ""
        print(f"| {k[0]} x {k[1]}, {k[2]}, {k[3]}, {k[4]}{mark} | " + " | ".join(
            f"{v[sh][0]:.1f}" if sh in v else "-" for sh in shapes) + " |")
    b = a["sweep_best"]
    print(f"\nBest: {b['block_m']} x {b['block_n']}, g_pack {b['g_pack']}, {b['num_warps']} warps, {b['num_stages']} "
          f"stages: {b['speedup_geomean_vs_default']:.3f}x the default's speed (geometric mean over the three shapes).")
    st = {f: {r["case"]: r for r in load(f"{base}/steps_prefill/{f}.json")["results"]} for f in ("default", "best")}
    d8, b8 = st["default"]["prefill:8192"], st["best"]["prefill:8192"]
    print(f"Inside the engine (`bench_steps.py --prefill 8192`, one 8192-token prompt, dummy Qwen3-8B, same lease): "
          f"{d8['step_ms_median']:.2f} ms with the 3-stage tiles ({d8['fraction_of_floor']:.1%} of the matmul "
          f"floor), {b8['step_ms_median']:.2f} ms with the best ({b8['fraction_of_floor']:.1%}).")
    prof = load(f"{base}/steps_prefill/profile.json")["profiles"][0]["graphs"]
    top = {t["name"]: t for t in prof["top"]}
    pk = top["_prefill_kernel"]
    print(f"Its kernel profile: the prefill attention kernel {pk['us_per_step'] / 1e3:.1f} ms of "
          f"{prof['gpu_us_per_step'] / 1e3:.1f} ms ({pk['us_per_step'] / pk['count_per_step']:.0f} us a layer, "
          "against 1,460 us for the same kernel and shape alone).")
    print("\nSide by side (`lease_1gpu.sh sbs`, SBS_CLIENTS=\"vllm pdserve\": vLLM 0.22, then pdserve, on one H200; "
          "dummy Qwen3-8B bf16; each server measured by vLLM's `bench serve`, then by `pdserve bench serve`; "
          f"kernels compiled while serving: {_compiles(f'{base}/sbs_c256/pdserve.log.gz')}):\n")
    comp = load(f"{base}/sbs_c256/comparison.json")
    _side_by_side(comp)
    print("\nThe two clients on the same server, back to back:\n")
    print("| server | metric | vLLM's client | pdserve's client | pdserve's / vLLM's |\n|---|---|---|---|---|")
    for srv in ("vllm", "pdserve"):
        v = load(f"{base}/sbs_c256/{srv}_single_1024x1024_c256.json")
        p = load(f"{base}/sbs_c256/{srv}_single_1024x1024_c256_pdclient.json")
        for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
            print(f"| {srv} | {k} | {v[k]:.2f} | {p[k]:.2f} | {p[k] / v[k]:.3f} |")
    long = load(f"{base}/sbs_long/comparison.json")
    print("\nOne prompt at a time (same lease, a second start of each server), vLLM's client with per-request records; "
          "16 tokens a request. vLLM streams them in fewer chunks, so its first chunk carries several tokens:\n")
    print("| workload | server | mean TTFT ms | mean TTFT after the first request ms | mean TPOT ms | chunks a request "
          "| median gap between chunks ms | mean end-to-end ms |\n|---|---|---|---|---|---|---|---|")
    for w in ("8192x16_c1", "32768x16_c1"):
        for srv in ("vllm", "pdserve"):
            r = load(f"{base}/sbs_long/{srv}_single_{w}.json")
            n, ttft, gap = _chunks(f"{base}/sbs_long/{srv}_single_{w}.json")
            print(f"| {w} | {srv} | {r['mean_ttft_ms']:.1f} | {ttft:.1f} | {r['mean_tpot_ms']:.2f} | {n:.1f} | "
                  f"{gap:.2f} | {r['mean_e2el_ms']:.1f} |")
    for srv in long["servers"]:
        v, p = srv["vllm"], srv["pdserve"]
        print(f"\nKV capacity on this second start: vLLM {v['kv_tokens']:,}, pdserve {p['kv_tokens']:,} tokens "
              f"({p['kv_tokens'] / v['kv_tokens']:.3f}x).")
    print("\nThe KV sizing lines of pdserve's log (the c256 start; dense Qwen3-8B):\n")
    with gzip.open(B / base / "sbs_c256" / "pdserve.log.gz", "rt") as f:
        for line in f:
            if "KV sizing" in line:
                print("    " + line.split("engine: ", 1)[1].rstrip())
    moe = load(f"{base}/moe_8k/comparison.json")
    print("\nQwen3-30B-A3B (dummy, fp8 KV on both; vLLM with `--attention-backend FLASH_ATTN`), 8192/16 one at a "
          "time:\n")
    _side_by_side(moe)
    n_v, t_v, g_v = _chunks(f"{base}/moe_8k/vllm_single_8192x16_c1.json")
    n_p, t_p, g_p = _chunks(f"{base}/moe_8k/pdserve_single_8192x16_c1.json")
    print(f"\nChunks a request: vLLM {n_v:.1f}, pdserve {n_p:.1f}; mean TTFT after the first request {t_v:.1f} vs "
          f"{t_p:.1f} ms; median gap between chunks {g_v:.2f} vs {g_p:.2f} ms.")


def _first_wave(rel: str) -> tuple[float, float, float, float]:
    """(mean TTFT ms, first wave's mean TTFT ms, the rest's mean TTFT ms, seconds from the first send to the first
    wave's last first token) of a closed-loop run at concurrency 256 kept with DETAILED=1 (compact_detail.py)."""
    d = load(rel)
    reqs = sorted(zip(d["start_times"], d["ttfts"]))
    t0 = reqs[0][0]
    w1, w2 = reqs[:256], reqs[256:]
    mean = lambda xs: 1e3 * sum(t for _, t in xs) / len(xs)  # noqa: E731
    return mean(reqs), mean(w1), mean(w2), max(s + t for s, t in w1) - t0


def _steps_table(runs: list[tuple[str, str]], cases: list[str]) -> None:
    """Decode steps (bench_steps.py JSON) of several variants side by side: each case's median ms and fraction of
    its floor, then the async batch-1 decode loops."""
    recs = [(name, load(rel)) for name, rel in runs]
    print("| step | floor ms | " + " | ".join(f"{n} ms (of floor)" for n, _ in recs) + " |")
    print("|---|---|" + "---|" * len(recs))
    for case in cases:
        rows = [{r["case"]: r for r in d["results"]}.get(case) for _, d in recs]
        if any(r is None for r in rows):
            continue
        print(f"| {case} | {rows[0]['floor_ms']:.2f} | "
              + " | ".join(f"{r['step_ms_median']:.2f} ({r['fraction_of_floor']:.0%})" for r in rows) + " |")
    loops = sorted({lp["case"] for _, d in recs for lp in d.get("loops", []) if lp["async"]})
    for case in loops:
        vals = [next((lp for lp in d.get("loops", []) if lp["case"] == case and lp["async"]), None) for _, d in recs]
        print(f"| {case}, async, ms a step | - | " + " | ".join(f"{v['step_ms']:.2f}" if v else "-" for v in vals)
              + " |")


def _srv_line(log_gz: str, key: str) -> str:
    with gzip.open(B / log_gz, "rt") as f:
        return next(ln for ln in f.read().splitlines() if key in ln)


def _chunk_count(rel: str) -> str:
    """Stream chunks a request (first, warm one, left out) against its output tokens: a chunk of several tokens
    moves their decode time from TPOT into TTFT."""
    d = load(rel)
    per = [len(i) + 1 for i in d["itls"][1:]]
    span = f"{min(per)}" if min(per) == max(per) else f"{min(per)}-{max(per)}"
    return f"{span} chunks for {d['output_lens'][1]} tokens"


def _sbs_cells(v: dict, p: dict, digits: int = 3) -> str:
    """A side-by-side row's cells after its label: output tok/s of both and their ratio, then mean TTFT and mean TPOT
    of both with the ratio (`digits` decimals)."""
    return (f"{v['output_throughput']:,.1f} | {p['output_throughput']:,.1f} | "
            f"{p['output_throughput'] / v['output_throughput']:.2f} | {v['mean_ttft_ms']:.1f} / "
            f"{p['mean_ttft_ms']:.1f} | {p['mean_ttft_ms'] / v['mean_ttft_ms']:.{digits}f} | {v['mean_tpot_ms']:.2f} / "
            f"{p['mean_tpot_ms']:.2f} | {p['mean_tpot_ms'] / v['mean_tpot_ms']:.{digits}f} |")


def _kernel_groups(prof: dict) -> list[tuple[str, float, float]]:
    """A profiled step's kernels in groups: (name, count a step, us a step), cuBLAS's GEMM kernels together."""
    groups: dict[str, list[float]] = {}
    for r in prof["top"]:
        name = r["name"]
        key = "cuBLAS GEMMs (nvjet, splitK reduce)" if name.startswith("nvjet") or "splitKreduce" in name else name[:60]
        g = groups.setdefault(key, [0.0, 0.0])
        g[0] += r["count_per_step"]
        g[1] += r["us_per_step"]
    return sorted(((k, c, us) for k, (c, us) in groups.items()), key=lambda x: -x[2])


def _script(name: str, rel: str):
    """A benchmarks/ script (not a package) loaded as module `name` from its path under benchmarks/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, B / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compare_module():
    return _script("vs_vllm_compare", "vs_vllm/compare.py")


def _paired_ttft(folder: str, run: str, rounds: int) -> list[tuple[int, float, float, float]]:
    """Per round: the clients' request start offsets (median |difference|, ms) and per-request TTFT differences
    (pdserve's client - vLLM's, median and mean ms), requests paired by index (same prompts and arrival times)."""
    import statistics as st

    out = []
    for k in range(1, rounds + 1):
        r = "" if k == 1 else f"_r{k}"
        v, p = load(f"{folder}/{run}{r}.json"), load(f"{folder}/{run}{r}_pdclient.json")
        vs = [t - v["start_times"][0] for t in v["start_times"]]
        ps = [t - p["start_times"][0] for t in p["start_times"]]
        d = [(b - a) * 1e3 for a, b in zip(v["ttfts"], p["ttfts"])]
        out.append((k, st.median(abs(b - a) for a, b in zip(vs, ps)) * 1e3, st.median(d), st.mean(d)))
    return out


def _ab_steps(runs: list[tuple[str, dict]]) -> None:
    """bench_steps.py runs of an A/B (label, JSON) side by side: each step's and each async loop's ms (of floor)."""
    print("| step | " + " | ".join(f"{v} ms (of floor)" for v, _ in runs) + " |\n|---|" + "---|" * len(runs))
    for i, r0 in enumerate(runs[0][1]["results"]):
        print(f"| {r0['case']} | " + " | ".join(
            f"{x['results'][i]['step_ms_median']:.2f} ({x['results'][i]['fraction_of_floor']:.0%})" for _, x in runs)
            + " |")
    for i, l0 in enumerate(runs[0][1]["loops"]):
        if l0["async"]:
            print(f"| {l0['case']} steady ({l0['rows_per_step']:.0f} rows at {l0['mean_context']:.0f}) | " + " | ".join(
                f"{x['loops'][i]['step_ms']:.2f} ({x['loops'][i]['fraction_of_floor']:.0%})" for _, x in runs) + " |")


def _ceilings(c: dict) -> str:
    """A run's measured ceilings (bench JSON "ceilings") as the tables' captions quote them."""
    return f"HBM copy {c['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s"


def _gpu_tests(rel: str) -> str:
    """The pytest summary line of a stage's GPU tests."""
    return next(ln for ln in reversed((B / rel).read_text().splitlines()) if " passed" in ln).strip()


def _sbs_table(folder: str) -> None:
    """A `lease_1gpu.sh sbs` folder's comparison table (each workload's output tok/s, mean TTFT and mean TPOT of
    both servers with ratios), then KV tokens and start-up of both."""
    print("| workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean TPOT "
          "vLLM / pdserve ms | ratio |\n|---|---|---|---|---|---|---|---|")
    for w in sorted(load(f"{folder}/comparison.json")["workloads"], key=lambda w: w["workload"]):
        print(f"| {w['workload']} | {_sbs_cells(w['vllm'], w['pdserve'])}")
    v, p = (load(f"{folder}/{n}_single_server.json") for n in ("vllm", "pdserve"))
    print(f"\nKV tokens: vLLM {v['kv_tokens']:,}, pdserve {p['kv_tokens']:,} ({p['kv_tokens'] / v['kv_tokens']:.4f}x); "
          f"start-up (launch to first completion): vLLM {v['startup_s']:.1f} s, pdserve {p['startup_s']:.1f} s.")


def _sbs_chunks(folder: str, workload: str) -> None:
    """Per server: TPOT, chunks a request for its tokens, the median gap between chunks and the end-to-end time
    (vLLM's client, per-request records): a chunk of several tokens moves their decode time from TPOT into TTFT."""
    for n in ("vllm", "pdserve"):
        d = load(f"{folder}/{n}_single_{workload}.json")
        chunks, gap = _chunk_stats(d)
        print(f"- {workload} {n}: TPOT mean {d['mean_tpot_ms']:.2f} ms; {chunks:.1f} chunks a request for "
              f"{d['output_lens'][0]} tokens; median gap between chunks {gap:.2f} ms; mean "
              f"TTFT {d['mean_ttft_ms']:.1f} ms; mean E2EL {d['mean_e2el_ms']:.1f} ms")


def _chunk_stats(d: dict) -> tuple[float, float]:
    """(mean chunks a request's stream carried, median gap between chunks ms) of a --save-detailed result; the
    near-zero gaps after the last token are left out."""
    gaps = sorted(g for r in d["itls"] for g in r if g > 1e-3)
    return sum(len(r) + 1 for r in d["itls"]) / len(d["itls"]), 1e3 * gaps[len(gaps) // 2]


def _misses(d: dict) -> tuple[float, float]:
    """(mean TTFT ms, mean E2EL ms) of a --save-detailed run's requests after its first, which re-sends a warm-up
    prompt (a prefix-cache hit on both servers)."""
    t = d["ttfts"][1:]
    e = [a + sum(r) for a, r in zip(d["ttfts"][1:], d["itls"][1:])]
    return 1e3 * sum(t) / len(t), 1e3 * sum(e) / len(e)


def session27() -> None:
    """Session 27 (one H200, then two 2xH200 machines): cuBLASLt's candidate algorithms for the decode products;
    the single-GPU side by side with 32k and 256-token outputs; decoders under a stream of long prompts."""
    base = "lease_s27"
    lt = load(f"{base}/s27a/lt_algos.json")
    print(f"cuBLASLt's candidate algorithms for Qwen3-8B's products (s27a, an H200, `probe_lt_algos.py`: up to 32 asked, "
          f"8 returned a shape; each timed in a CUDA graph over weight copies larger than L2 and checked against "
          f"torch.mm; same run: {_ceilings(lt['ceilings'])}), the best candidate against torch's own pick (the first "
          f"answer), us:\n")
    rows = sorted({r["rows"] for r in lt["results"]})
    print("| projection | " + " | ".join(f"{m} rows: torch / best" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for shape in dict.fromkeys(r["shape"] for r in lt["results"]):
        cells = []
        for m in rows:
            r = next(r for r in lt["results"] if r["shape"] == shape and r["rows"] == m)
            b = r["best"]["us"] if r["best"] else float("nan")
            cells.append(f"{r['torch_us']:.1f} / {b:.1f}")
        print(f"| {shape} | " + " | ".join(cells) + " |")
    print()
    for m in rows:
        rs = [r for r in lt["results"] if r["rows"] == m and r["best"]]
        t = sum(r["torch_us"] * (1 if r["shape"] == "lm_head" else 36) for r in rs)
        b = sum(min(r["best"]["us"], r["torch_us"]) * (1 if r["shape"] == "lm_head" else 36) for r in rs)
        print(f"- {m} rows: a step's products {t / 1e3:.2f} ms with torch's pick, {b / 1e3:.2f} ms with the best "
              f"candidate of each ({(t - b) / 1e3:.2f} ms less)")
    loop = load(f"{base}/s27a/loop_base1.json")
    for r in loop["loops"]:
        if r["async"]:
            print(f"- the same call, {r['case']} steady at temperature 1 as shipped: {r['step_ms']:.2f} ms a step, "
                  f"floor {r['floor_ms']:.2f} ms ({r['fraction_of_floor']:.0%})")
    sbs = f"{base}/sbs"
    print(f"\nOne GPU each at once (sbs/, a 2xH200 machine, `SBS_WORKLOADS=... SBS_ROUNDS=1 SBS_CLIENTS=vllm "
          f"lease_2xh200.sh sbs`, code {load(f'{sbs}/comparison.json')['commit'][:7]}; kernels pdserve compiled while "
          f"serving: {_compiles(f'{sbs}/pdserve.log.gz')}), vLLM's client. The 256-token runs follow the 16-token "
          f"runs of the same length and seed, so their prompts are prefix-cache hits on both servers: their TTFT is "
          f"not a prefill, their TPOT is the steady pace of one request at that context:\n")
    _sbs_table(sbs)
    print()
    for w in ("8192x16_c1", "32768x16_c1", "8192x256_c1", "32768x256_c1"):
        _sbs_chunks(sbs, w)
    for folder, note in (("interfere_r1", "round 1: 64 decoders, a warm-up request each client, the long stream 4 s "
                          "after the decoders; in vLLM's arm the decoders' warm-up request outlasted the long stream, "
                          "so its run did not overlap it (overlap 0) and says nothing"),
                         ("interfere", "round 2, another machine: 128 decoders, no warm-up requests, the long stream 8 "
                          "s after the decoders")):
        print(f"\nDecoders under a stream of long prompts ({folder}/, `lease_2xh200.sh interfere`, "
              f"benchmarks/vs_vllm/interference.sh; {note}). Decoders: 1024 in / 1024 out at concurrency 32, alone, "
              f"then again with 8 prompts of 32768 tokens (1 out) sent one at a time; vLLM on GPU 0, the pdserve arms "
              f"(--max-long-prefill-tokens N) one after the other on GPU 1; vLLM's client:\n")
        interference_table(f"{base}/{folder}")


def _stats_lines(log_gz: str) -> list[dict]:
    """The engine's stats lines (pdserve.server.stats) of a server's log, parsed."""
    pat = re.compile(r"^(\S+ \S+) INFO pdserve\.server\.stats: engine: prompt ([0-9.]+) tokens/s, generation ([0-9.]+) "
                     r"tokens/s; ([0-9.]+) steps/s, busy ([0-9]+)%, ([0-9.]+) ms a step, ([0-9]+)% of it waiting for the "
                     r"GPU; running ([0-9]+), waiting ([0-9]+); KV cache ([0-9.]+)% used")
    keys = ("prompt_tps", "gen_tps", "steps_ps", "busy", "step_ms", "gpu_wait", "running", "waiting", "kv_used")
    with gzip.open(B / log_gz, "rt") as f:
        return [{"time": m.group(1)[11:19], **{k: float(v) for k, v in zip(keys, m.groups()[1:])}}
                for ln in f if (m := pat.match(ln))]


def _steps_bounds(rel: str) -> None:
    """A bench_steps.py record's cases and async loops against their floors and serial bounds."""
    d = load(rel)
    print("| step | path | ms | floor ms (of it) | serial bound ms (of it) |\n|---|---|---|---|---|")
    for r in d["results"]:
        print(f"| {r['case']} | {r['path']} | {r['step_ms_median']:.2f} | {r['floor_ms']:.2f} "
              f"({r['fraction_of_floor']:.0%}) | {r['serial_bound_ms']:.2f} ({r['fraction_of_serial_bound']:.0%}) |")
    for lp in d.get("loops", []):
        if lp["async"]:
            print(f"| {lp['case']}, async, host {lp['host_ms']:.2f} ms a step | engine loop | {lp['step_ms']:.2f} | "
                  f"{lp['floor_ms']:.2f} ({lp['fraction_of_floor']:.0%}) | {lp['serial_bound_ms']:.2f} "
                  f"({lp['fraction_of_serial_bound']:.0%}) |")


ROUTE_KERNELS = ("softmax_warp_forward", "sbtopk::gatherTopK", "bitonicSortKVInPlace", "_count_kernel", "_offsets_kernel",
                 "_scatter_kernel", "FillFunctor")  # kernels only a MoE layer's torch routing and row grouping launch


def _server_side(folder: str) -> None:
    """Each run's means as the servers' own /metrics histograms measured them (server_latency.py), beside vLLM's
    client's; and how far each client's TTFT and E2E lie past the server's own."""
    c = load(f"{folder}/comparison.json")
    print("| workload | requests counted (with the client's warm-ups) | server TTFT vLLM / pdserve ms | server inter-token "
          "vLLM / pdserve ms | ratio | vLLM's TPOT a request (server) ms | client TPOT vLLM / pdserve ms | client TTFT "
          "- server TTFT, vLLM / pdserve ms | client E2E - server E2E, vLLM / pdserve ms |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for w in sorted(c["workloads"], key=lambda w: w["workload"]):
        v, p = w["vllm"], w["pdserve"]
        vs, ps = v["server"], p["server"]
        print(f"| {w['workload']} | {vs['requests']} / {ps['requests']} | {vs['ttft']['mean_ms']:.1f} / "
              f"{ps['ttft']['mean_ms']:.1f} | {vs['itl']['mean_ms']:.2f} / {ps['itl']['mean_ms']:.2f} | "
              f"{w['ratio']['server_itl']:.3f} | {vs['tpot']['mean_ms']:.2f} | {v['mean_tpot_ms']:.2f} / "
              f"{p['mean_tpot_ms']:.2f} | {v['mean_ttft_ms'] - vs['ttft']['mean_ms']:.1f} / "
              f"{p['mean_ttft_ms'] - ps['ttft']['mean_ms']:.1f} | {v['mean_e2el_ms'] - vs['e2el']['mean_ms']:.1f} / "
              f"{p['mean_e2el_ms'] - ps['e2el']['mean_ms']:.1f} |")


def _profile_top(rel: str, n: int) -> dict:
    """A bench_steps --profile record's graphed step: its first n kernels by time, with their marginal time."""
    g = load(rel)["profiles"][0]["graphs"]
    print(f"{g['kernels_per_step']:.0f} kernels a step, {g['gpu_us_per_step'] / 1e3:.2f} ms of kernel time:\n")
    print("| kernel | launches a step | us a step | marginal us a step |\n|---|---|---|---|")
    for t in g["top"][:n]:
        print(f"| {t['name'][:70]} | {t['count_per_step']:.0f} | {t['us_per_step']:.0f} | "
              f"{t['marginal_us_per_step']:.0f} |")
    return g


def _sweep_rows(rel: str) -> list[dict]:
    return [r for r in load(rel)["rows"] if r.get("us")]


def _sweep_variant(r: dict) -> str:
    tile = "(" + ", ".join(map(str, r["tile"])) + ")"
    parts = [tile] + (["read ahead"] if r.get("prefetch") else []) + (["V by PTX"] if r.get("v_widen") else [])
    return ", ".join(parts)


def _run_table(d: dict, serial: bool = False) -> None:
    """A bench_steps.py run's steps and async loops: path, floor (its bound), ms, share of the floor (and, `serial`,
    of the serial bound)."""
    extra = (" of serial bound |", "---|") if serial else ("", "")
    print(f"| step | path | floor ms (bound) | ms | of floor |{extra[0]}\n|---|---|---|---|---|{extra[1]}")
    for r in d["results"]:
        print(f"| {r['case']} | {r['path']} | {r['floor_ms']:.2f} ({r['bound']}) | {r['step_ms_median']:.2f} | "
              f"{r['fraction_of_floor']:.0%} |" + (f" {r['fraction_of_serial_bound']:.0%} |" if serial else ""))
    for lp in d["loops"]:
        if lp["async"]:
            print(f"| {lp['case']} steady, async ({lp['rows_per_step']:.0f} rows at {lp['mean_context']:.0f}) | "
                  f"engine loop | {lp['floor_ms']:.2f} (memory) | {lp['step_ms']:.2f} | {lp['fraction_of_floor']:.0%} |"
                  + (f" {lp['fraction_of_serial_bound']:.0%} |" if serial else ""))


def _arms_table(base: str, arms: list[str], first: int = 1) -> dict[str, list[float]]:
    """Steps and async loops of `bench_steps.py` runs `steps_<i>_<arm>.json` under `base` (one process an arm, in the
    order given, i from `first`), ms a step (of the floor) per case; returns each case's times in arm order."""
    runs = [(a, load(f"{base}/steps_{i}_{a}.json")) for i, a in enumerate(arms, first)]

    def cases(d: dict) -> dict[str, tuple[float, float]]:
        out = {r["case"]: (r["step_ms_median"], r["floor_ms"]) for r in d["results"]}
        out.update({x["case"]: (x["step_ms"], x["floor_ms"]) for x in d["loops"] if x["async"]})
        return out

    got = [cases(d) for _, d in runs]
    print("| step | " + " | ".join(f"{a} ({i}) ms (of floor)" for i, (a, _) in enumerate(runs, first)) + " |\n|---|"
          + "---|" * len(runs))
    times = {}
    for n in got[0]:
        print(f"| {n} | " + " | ".join(f"{g[n][0]:.2f} ({g[n][1] / g[n][0]:.0%})" for g in got) + " |")
        times[n] = [g[n][0] for g in got]
    return times


def _arm_deltas(times: dict[str, list[float]], arms: list[str], base_arm: str, cases: list[str]) -> str:
    """Each arm's mean less `base_arm`'s mean, per case."""
    out = []
    for n in cases:
        mean = {a: sum(t for t, b in zip(times[n], arms) if b == a) / arms.count(a) for a in dict.fromkeys(arms)}
        out.append(f"{n} " + ", ".join(f"{a} {mean[a] - mean[base_arm]:+.2f} ms" for a in mean if a != base_arm))
    return "; ".join(out)


def _moe_sbs(folder: str, before_folder: str, before_label: str) -> list[str]:
    """A MoE side by side's tables (`_sbs_table`, `_server_side`) and each workload's ratios against an earlier
    session's (`before_label` names it); returns pdserve's log lines."""
    _sbs_table(folder)
    print("\nThe servers' own means over the same runs:\n")
    _server_side(folder)
    before = {w["workload"]: w["ratio"] for w in load(f"{before_folder}/comparison.json")["workloads"]}
    now = {w["workload"]: w["ratio"] for w in load(f"{folder}/comparison.json")["workloads"]}
    print()
    for k in sorted(now):
        print(f"- {k}: output {now[k]['output_throughput']:.3f}x vLLM's ({before_label}"
              f"{before[k]['output_throughput']:.3f}x), mean TTFT {now[k]['mean_ttft']:.3f} "
              f"({before[k]['mean_ttft']:.3f}), mean TPOT by the client {now[k]['mean_tpot']:.3f} "
              f"({before[k]['mean_tpot']:.3f}), the servers' own inter-token latency {now[k]['server_itl']:.3f} "
              f"({before[k]['server_itl']:.3f})")
    return gzip.decompress((B / f"{folder}/pdserve.log.gz").read_bytes()).decode(errors="replace").splitlines()


def status() -> None:
    """Issue 10's criteria, each from its latest record (named beside it): the table docs/benchmarks.md opens with."""
    dense, long = "lease_s41/dense", "lease_s43/dense_nocache"  # 1024/1024 c256; 8k and 32k one at a time
    r = {w["workload"]: w["ratio"] for w in load(f"{dense}/comparison.json")["workloads"]}
    r.update({w["workload"]: w["ratio"] for w in load(f"{long}/comparison.json")["workloads"]})
    v, p = (load(f"{long}/{n}_single_server.json") for n in ("vllm", "pdserve"))
    st = {w: _server_ttft_ratio(long, w) for w in ("8192x16_c1", "32768x16_c1")}
    loops = {lp["case"]: lp for lp in load("lease_s41/s41a/steps.json")["loops"] if lp["async"]}
    pf = next(x for x in load("lease_s42/s42a/steps.json")["results"] if x["case"] == "prefill:8192")
    pv, pp = (load(f"lease_s42/pd/pd-{n}/{n}_pd_1024x1024_c256.json") for n in ("vllm", "pdserve"))
    c256, k8, k32 = r["1024x1024_c256"], r["8192x16_c1"], r["32768x16_c1"]
    ge, le = ">=", "<="
    rows = [  # (criterion, measured, >= or <=, bound, note, record)
        ("1024/1024 c256, output tok/s, pdserve / vLLM", c256["output_throughput"], ge, 1.0, "aim 1.15", dense),
        ("same, mean TPOT", c256["mean_tpot"], le, 1.0, "", dense),
        ("same, mean TTFT", c256["mean_ttft"], le, 1.0, "", dense),
        ("8192/16 one at a time, TTFT", k8["mean_ttft"], le, 1.0,
         f"by the servers' own clocks {st['8192x16_c1']:.3f}", long),
        ("8192/16, TPOT", k8["mean_tpot"], le, 1.1, "", long),
        ("32768/16 one at a time, TTFT", k32["mean_ttft"], le, 1.0,
         f"by the servers' own clocks {st['32768x16_c1']:.3f}; E2E {k32['mean_e2el']:.3f}", long),
        ("32768/16, TPOT", k32["mean_tpot"], le, 1.1,
         f"by vLLM's client, which sees vLLM's tokens in fewer chunks; by the servers' own inter-token latency "
         f"{k32['server_itl']:.3f}", long),
        ("KV tokens at --gpu-memory-utilization 0.9", p["kv_tokens"] / v["kv_tokens"], ge, 1.0, "", long),
        ("start-up, launch to first answer", p["startup_s"] / v["startup_s"], le, 1.0, "", long),
        ("steady decode at batch 1, of its floor", loops["loop:1x1024"]["fraction_of_floor"], ge, 0.8, "",
         "lease_s41/s41a"),
        ("steady decode at batch 256, of its floor", loops["loop:256x1024"]["fraction_of_floor"], ge, 0.8,
         f"{loops['loop:256x1024']['fraction_of_serial_bound']:.3f} of its serial bound", "lease_s41/s41a"),
        ("prefill of 8k tokens, of the matmul ceiling", pf["fraction_of_floor"], ge, 0.75, "", "lease_s42/s42a"),
        ("1P1D 1024/1024 c256, output tok/s, pdserve / vLLM's 1P1D (NIXL)",
         pp["output_throughput"] / pv["output_throughput"], ge, 1.0, "", "lease_s42/pd"),
    ]
    print("| criterion | measured | asked | met | note | record |\n|---|---|---|---|---|---|")
    for name, x, op, bound, note, rec in rows:
        met = x >= bound if op == ge else x <= bound
        print(f"| {name} | {x:.3f} | {op} {bound} | {'yes' if met else 'no'} | {note} | benchmarks/{rec} |")


def _server_ttft_ratio(folder: str, workload: str) -> float:
    """pdserve's mean TTFT over vLLM's by the servers' own /metrics (server_latency.py) for one run."""
    v, p = (load(f"{folder}/{n}_single_{workload}.server.json")["ttft"]["mean_ms"] for n in ("vllm", "pdserve"))
    return p / v


def session43() -> None:
    """Session 43 (one H200 lease, two machines): the long-prefill merge's launch variants and the one shipped; the
    8k and 32k prompts beside vLLM with prefix caching off on both."""
    base = "lease_s43"
    m = load(f"{base}/s43a/merge.json")
    print("The long-prefill row's merge (merge.py's _merge_two_kernel: the two cuDNN calls' outputs combined by their "
          "log-sum-exps) on the inputs library_prefill.attend_row hands it, dummy Qwen3-8B's heads (32 x 128, bf16), "
          f"launch variants (s43a, machine 1, `lease_1gpu.sh s43a`: benchmarks/attention/bench_merge.py; same run: HBM "
          f"copy {m['hbm_copy_GBps']:,.0f} GB/s). Arms `<align>:<rows a program>:<warps>`; free: no pointer "
          "specialized on its alignment (as built until this session); o: the outputs' pointers specialized, the "
          "log-sum-exps' not. us a layer (of the copy rate):\n")
    show = ["free:32:4", "free:16:2", "o:32:4", "o:32:8", "o:16:4"]
    print("| prefix + new | " + " | ".join(show) + " | max abs diff to the reference (every arm) |\n|---|"
          + "---|" * (len(show) + 1))
    for c in m["cases"]:
        a = {x["arm"]: x for x in c["arms"]}
        diff = max(x["max_abs_diff_ref"] for x in c["arms"])
        print(f"| {c['ctx']} + {c['new']} | " + " | ".join(f"{a[k]['us']:.1f} ({a[k]['of_copy']:.0%})" for k in show)
              + f" | {diff:.1e} |")
    t = m["total_us"]
    print(f"\n- over the five rows: {m['best']} {t[m['best']]:.1f} us against free:32:4's {t['free:32:4']:.1f} "
          f"({t['free:32:4'] / t[m['best']]:.2f}x); every free arm {min(v for k, v in t.items() if k.startswith('free')):.1f}"
          f" us or more, every o arm {max(v for k, v in t.items() if k.startswith('o:')):.1f} us or less")
    eq = [x["arm"] for x in m["cases"][0]["arms"] if x["arm"].startswith("o:") and x["equal_free_32_4"]]
    print(f"- bitwise equal to free:32:4's output on {m['cases'][0]['ctx']} + {m['cases'][0]['new']}: the free arms; "
          f"of the o arms {', '.join(eq) or 'none'} (the others round a few values differently, each within the "
          "difference above)")
    print("- shipped: merge.py specializes O1, O2 and Out on their 16-byte alignment (the log-sum-exps stay free: "
          f"one binary for every chunk) and takes {m['best'].split(':')[1]} rows a program with "
          f"{m['best'].split(':')[2]} warps ({m['best']})")
    runs = []
    for i, arm in ((1, "free:32:4"), (2, m["best"])):
        runs.append((arm, {r["case"]: r["step_ms_median"] for r in load(f"{base}/s43a/steps_{i}.json")["results"]}))
    for ln in (B / base / "s43a/stdout.txt").read_text().splitlines():  # runs 3 and 4: their JSONs did not come back
        if ln[:2] in ("3 ", "4 "):
            cells = re.findall(r"(prefill:\S+): ([\d.]+) ms", ln)
            runs.append((ln.split()[1], {k: float(v) for k, v in cells}))
    print("\nWhole chunks with each merge (s43a, the same call: bench_steps.py run by bench_merge.py --run-with ARM, "
          "--iters 5, each step run and waited for; runs 3 and 4 from the call's printed lines, their JSONs over the "
          "tool's file count), ms a step:\n")
    cases = list(runs[0][1])
    print("| run | merge | " + " | ".join(cases) + " |\n|---|---|" + "---|" * len(cases))
    for i, (arm, d) in enumerate(runs, 1):
        print(f"| {i} | {arm} | " + " | ".join(f"{d[c]:.2f}" for c in cases) + " |")
    for c in cases:
        a = [d[c] for arm, d in runs if arm == "free:32:4"]
        b = [d[c] for arm, d in runs if arm != "free:32:4"]
        print(f"- {c}: mean {sum(a) / len(a):.2f} ms with free:32:4, {sum(b) / len(b):.2f} ms with {m['best']} "
              f"({sum(b) / len(b) - sum(a) / len(a):+.2f} ms; the runs of one arm differ by up to "
              f"{max(max(a) - min(a), max(b) - min(b)):.2f} ms)")

    print(f"\nThe GPU tests at the new launch (s43b, machine 1 again, `lease_1gpu.sh s43b`: test_library_prefill.py, "
          f"test_warmup.py): `{_gpu_tests(f'{base}/s43b/gpu_tests.txt')}`")
    print("\nThe 24k chunk's kernels with the merge as before and as shipped (s43b, the same call, bench_steps.py "
          "--profile prefill:24576+8192, one process each):\n")
    print("| merge | kernels a step | kernel time ms a step | _merge_two_kernel us a step | GPU idle ms a step |\n"
          "|---|---|---|---|---|")
    for arm, n in (("free:32:4", "free_32_4"), (f"shipped ({m['best']})", "shipped")):
        g = load(f"{base}/s43b/profile_{n}.json")["profiles"][0]["graphs"]
        mk = next(x for x in g["top"] if x["name"] == "_merge_two_kernel")
        print(f"| {arm} | {g['kernels_per_step']:.0f} | {g['gpu_us_per_step'] / 1e3:.2f} | {mk['us_per_step']:.0f} | "
              f"{g['gpu']['idle_us_per_step'] / 1e3:.2f} |")
    d = load(f"{base}/s43b/steps.json")
    print(f"\nDummy Qwen3-8B's 32768-token prompt as four 8192-token chunks at the new launch (s43b, the same call, as "
          f"s42a; same run: {_ceilings(d['ceilings'])}):\n")
    _run_table(d, serial=True)
    rs = d["results"]
    tot, fl = sum(r["step_ms_median"] for r in rs), sum(r["floor_ms"] for r in rs)
    print(f"\n- the four chunks together: {tot:.1f} ms against {fl:.1f} ms of floor ({fl / tot:.0%})")

    f = f"{base}/dense_nocache"
    print("\nDummy Qwen3-8B (bf16) beside vLLM 0.22 with prefix caching off on both (machine 2, after thirteen staging "
          "calls and `lease_2xh200.sh unpack`: `SBS_WORKLOADS=\"32768:16:10:1 8192:16:16:1\" "
          "VLLM_ARGS=--no-enable-prefix-caching PDSERVE_ARGS=--no-enable-prefix-caching lease_1gpu.sh dense`: vLLM "
          "then pdserve on the one GPU, vLLM's `bench serve` for both). Without a prefix cache every request is fresh, "
          "the client's two warm-ups too, so the servers' own /metrics means are over fresh prompts only:\n")
    _sbs_table(f)
    print("\n| workload | client TTFT vLLM / pdserve ms | ratio | client E2E vLLM / pdserve ms | ratio | server TTFT "
          "vLLM / pdserve ms | ratio | server inter-token vLLM / pdserve ms | ratio | client TTFT - server TTFT, "
          "vLLM / pdserve ms |\n|---|---|---|---|---|---|---|---|---|---|")
    for w in ("32768x16_c1", "8192x16_c1"):
        cv, cp = (load(f"{f}/{n}_single_{w}.json") for n in ("vllm", "pdserve"))
        sv, sp = (load(f"{f}/{n}_single_{w}.server.json") for n in ("vllm", "pdserve"))
        tv, tp = sv["ttft"]["mean_ms"], sp["ttft"]["mean_ms"]
        iv, ip = sv["itl"]["mean_ms"], sp["itl"]["mean_ms"]
        print(f"| {w} | {cv['mean_ttft_ms']:.1f} / {cp['mean_ttft_ms']:.1f} | "
              f"{cp['mean_ttft_ms'] / cv['mean_ttft_ms']:.3f} | {cv['mean_e2el_ms']:.1f} / {cp['mean_e2el_ms']:.1f} | "
              f"{cp['mean_e2el_ms'] / cv['mean_e2el_ms']:.3f} | {tv:.1f} / {tp:.1f} | {tp / tv:.3f} | {iv:.2f} / "
              f"{ip:.2f} | {ip / iv:.3f} | {cv['mean_ttft_ms'] - tv:.1f} / {cp['mean_ttft_ms'] - tp:.1f} |")
    print()
    for w in ("32768x16_c1", "8192x16_c1"):
        _sbs_chunks(f, w)
    print("- both servers' clocks start before they tokenize the prompt (server_latency.py); vLLM's first token "
          "reaches its client later than its engine stamps it, with the tokens made meanwhile in the same chunk")


def session42() -> None:
    """Session 42 (machine 1, an H200: the 32k prompt's four chunks and the last one's kernels; machine 2, a 2xH200:
    vLLM and NIXL staged, 1P1D against vLLM's 1P1D, then the library row against vLLM's FlashAttention 3)."""
    base = "lease_s42"
    d = load(f"{base}/s42a/steps.json")
    print(f"Dummy Qwen3-8B's 32768-token prompt as the engine takes it: four 8192-token chunks, each on a prefix whose KV "
          f"is in the pool (s42a, machine 1, `lease_1gpu.sh s42a`: bench_steps.py --prefill 8192,8192+8192,16384+8192,"
          f"24576+8192 --iters {d['args']['iters']}, each step run and waited for; same run: {_ceilings(d['ceilings'])}):"
          f"\n")
    _run_table(d, serial=True)
    rs = d["results"]
    tot, fl = sum(r["step_ms_median"] for r in rs), sum(r["floor_ms"] for r in rs)
    print(f"\n- the four chunks together: {tot:.1f} ms against {fl:.1f} ms of floor ({fl / tot:.0%})")
    print("\nThe last chunk (24576+8192) under the profiler (the same call): ", end="")
    g = _profile_top(f"{base}/s42a/profile.json", 9)
    last = next(r for r in rs if r["case"] == "prefill:24576+8192")
    top = g["top"]
    att = sum(t["us_per_step"] for t in top if t["name"].startswith("cudnn"))
    gemm = sum(t["us_per_step"] for t in top if t["name"].startswith("nvjet"))
    rest = g["gpu_us_per_step"] - att - gemm
    print(f"\n- cuDNN's attention {att / 1e3:.1f} ms for {last['attn_flops'] / 1e12:.1f} TFLOP "
          f"({last['attn_flops'] / att / 1e6:.0f} TFLOP/s); cuBLAS's products {gemm / 1e3:.1f} ms for "
          f"{last['prod_flops'] / 1e12:.1f} TFLOP ({last['prod_flops'] / gemm / 1e6:.0f} TFLOP/s, "
          f"{last['prod_flops'] / gemm / 1e6 / d['ceilings']['bf16_matmul_tflops']:.0%} of the run's matmul rate); "
          f"every other kernel {rest / 1e3:.1f} ms; GPU idle {g['gpu']['idle_us_per_step'] / 1e3:.2f} ms")

    folder = "lease_s41/dense"
    (vt, ve), (pt, pe) = (_misses(load(f"{folder}/{n}_single_32768x16_c1.json")) for n in ("vllm", "pdserve"))
    v1, p1 = (load(f"{folder}/{n}_single_32768x16_c1.json")["ttfts"][0] for n in ("vllm", "pdserve"))
    print(f"\nSession 41's 32768/16 records read again (lease_s41/dense, vLLM's client, one request at a time): each "
          f"server's first request re-sent a warm-up prompt and hit its prefix cache (TTFT vLLM {1e3 * v1:.1f} ms, "
          f"pdserve {1e3 * p1:.1f} ms), and the servers' own histograms also count the two warm-ups, so their means mix "
          f"cached and fresh prompts. Over the seven fresh prompts after it: mean TTFT vLLM {vt:.1f} ms, pdserve "
          f"{pt:.1f} ms ({pt / vt:.3f}); mean E2E vLLM {ve:.1f} ms, pdserve {pe:.1f} ms ({pe / ve:.3f})")

    t = load(f"{base}/s42b/library_row.json")
    print("\nThe library row (pdserve's long-prefill attention: the prefix gathered out of the pool, cuDNN's two calls, "
          "their merge) against vLLM 0.22's FlashAttention 3 (`vllm.vllm_flash_attn`, fa_version=3, reading the same "
          "pool's pages through its block table), one layer of dummy Qwen3-8B's heads (32 x 128 over 8 KV heads, "
          "bf16, blocks of 16 tokens in random pages), the 32k prompt's chunks (s42b, machine 2 after the 1P1D runs, "
          "`lease_1gpu.sh s42b`: bench_library_row.py --fa3), us a layer:\n")
    print("| prefix + new | row us (TFLOP/s) | cuDNN's calls alone us | FA3 us (TFLOP/s) | row / FA3 | FA3's paged "
          "cache | max abs diff FA3 - row |\n|---|---|---|---|---|---|---|")
    for r in t["results"]:
        print(f"| {r['ctx']} + {r['new']} | {r['row_us']:.1f} ({r['row_tflops']:.0f}) | {r['calls_us']:.1f} | "
              f"{r['fa3_us']:.1f} ({r['fa3_tflops']:.0f}) | {r['row_us'] / r['fa3_us']:.3f} | {r['fa3_layout']} | "
              f"{r['fa3_max_abs_diff']:.1e} |")
    row = sum(r["row_us"] for r in t["results"]) * 36 / 1e3
    fa3 = sum(r["fa3_us"] for r in t["results"]) * 36 / 1e3
    print(f"\n- the four chunks' attention at 36 layers: row {row:.1f} ms, FA3 {fa3:.1f} ms ({row - fa3:.1f} ms, "
          f"{(row - fa3) / tot:.1%} of s42a's four chunks on machine 1); FA3 ships inside vLLM's wheel, not as a "
          f"library of its own, and its {(row - fa3) / tot:.1%} does not pay for a dependency: the library row stays")

    print("\nOne call of cuDNN's frontend graph in place of the library row (s42c1 and s42c2, machines 3 and 4, an H200 "
          "each, `lease_1gpu.sh s42c` carrying nvidia-cudnn-frontend 1.14.0's wheel: "
          "benchmarks/attention/probe_cudnn_frontend.py; s42c1 ran it before its gathered and padded arms were added). "
          "The row reaches cuDNN through torch's SDPA op, which has no bottom-right causal mask and no paged K/V: it "
          "gathers the prefix, makes two calls and merges them. The frontend graph takes one call, causal aligned "
          "bottom-right: dense over the gathered prefix and the new K/V copied into one buffer, gathered over the whole "
          "row gathered out of the pool by the row's kernel in one launch, paged over the pool's pages through a page "
          "table. Every plan of cuDNN's heuristics (A, FALLBACK) timed; us a layer, best plan (with its inputs made in "
          "the timed call where the arm has any):\n")
    print("| run | prefix + new | row | dense call | dense with inputs | gathered call | gathered with its gather | "
          "paged | padded graph / exact graph |\n|---|---|---|---|---|---|---|---|---|")
    sums: dict[str, list[float]] = {}
    for run in ("s42c1", "s42c2"):
        fe = load(f"{base}/{run}/cudnn_fe.json")
        for r in fe["results"]:
            def best(arm: str, key: str = "us", r: dict = r) -> str:
                b = (r.get(arm) or {}).get("best")
                return f"{b[key]:.1f}" if b and key in b else "-"
            pad = "-"
            if r.get("padded") and r.get("padded_exact"):
                pl = r["padded_lengths"]
                pad = (f"{r['padded']['best']['us']:.1f} / {r['padded_exact']['best']['us']:.1f} ({pl['q']} + "
                       f"{pl['kv'] - pl['q']} in a {pl['graph_q']} x {pl['graph_kv']} graph; max abs diff "
                       f"{r['padded']['best']['max_abs_diff']:.1e})")
            print(f"| {run} | {r['ctx']} + {r['new']} | {r['row_us']:.1f} | {best('dense')} | "
                  f"{best('dense', 'with_inputs_us')} | {best('gathered')} | {best('gathered', 'with_inputs_us')} | "
                  f"{best('paged')} | {pad} |")
            for arm, key in (("row", None), ("dense", "us"), ("gathered", "with_inputs_us"), ("paged", "us")):
                v = r["row_us"] if key is None else ((r.get(arm) or {}).get("best") or {}).get(key)
                if v is not None:
                    sums.setdefault(f"{run} {arm}", []).append(v)
    print("\n- the four chunks at 36 layers, ms: " + "; ".join(
        f"{k} {36 * sum(v) / 1e3:.1f}" for k, v in sums.items() if len(v) == 4))
    diffs = [p["max_abs_diff"] for run in ("s42c1", "s42c2") for r in load(f"{base}/{run}/cudnn_fe.json")["results"]
             for arm in ("dense", "gathered", "paged") for p in (r.get(arm) or {}).get("plans", [])
             if "max_abs_diff" in p]
    print(f"- every plan's output against the row's: max abs difference at most {max(diffs):.1e}")
    rs = [r for run in ("s42c1", "s42c2") for r in load(f"{base}/{run}/cudnn_fe.json")["results"]]

    def span(xs: list[float], pct: bool = False) -> str:
        return (f"{min(xs):.0%} to {max(xs):.0%}" if pct else f"{min(xs):.0f}-{max(xs):.0f}")

    dense_rate = [r["dense"]["best"]["tflops"] for r in rs if r["ctx"] >= 16384]
    row_rate = [r["row_tflops"] for r in rs]
    call = [r["row_us"] / r["dense"]["best"]["us"] - 1 for r in rs]
    gath = [r["row_us"] / r["gathered"]["best"]["with_inputs_us"] - 1 for r in rs if r.get("gathered")]
    paged = [r["paged"]["best"]["us"] / r["row_us"] - 1 for r in rs]
    pad = [r["padded"]["best"]["us"] / r["padded_exact"]["best"]["us"] - 1 for r in rs if r.get("padded")]
    print(f"- the dense call on prefixes of 16384 and 24576 ran {span(dense_rate)} TFLOP/s across the two processes, "
          f"the row {span(row_rate)} over every case: the row's time over the dense call's less one, {span(call, True)}; "
          f"over the gathered arm's with its gather, {span(gath, True)}; the paged reads through 16-token pages, "
          f"{span(paged, True)} slower than the row; a graph of a bucket's dims serving shorter lengths through its "
          f"padding mask, {span(pad, True)} against a graph of the exact dims. Each arm timed apart, the spread "
          f"between the two processes was as large as the differences, hence s42d")
    print("\nThe row and the gathered arm (its gather inside the timed call) one after the other, round by round (s42d, "
          "machine 5, an H200, `lease_1gpu.sh s42d` carrying the same wheel: `probe_cudnn_frontend.py --interleave 7`, "
          "two processes one after the other), median us a layer of the rounds:\n")
    print("| process | prefix + new | row | gathered, first plan | gathered, fastest plan | row / gathered (fastest) |"
          "\n|---|---|---|---|---|---|")
    ratios = []
    for i in (1, 2):
        for r in load(f"{base}/s42d/cudnn_fe_{i}.json")["results"]:
            med = {k: sorted(v)[len(v) // 2] for k, v in r["interleaved"].items()}
            ratios.append(med["row"] / med["gathered_best"])
            print(f"| {i} | {r['ctx']} + {r['new']} | {med['row']:.1f} | {med['gathered_first']:.1f} | "
                  f"{med['gathered_best']:.1f} | {ratios[-1]:.3f} |")
    print(f"\n- timed side by side, the one-call graph with its gather is {min(ratios):.3f}-{max(ratios):.3f}x the "
          f"row's speed: no gain worth a dependency. Not taken; the row stays")
    print("\n1P1D on 2xH200 at the session's tree (machine 2: vLLM 0.22 and NIXL 1.5.1 staged in thirteen calls, "
          "`lease_2xh200.sh unpack`, then `PD_MODE=pd-pdserve lease_2xh200.sh pd_one` and `PD_MODE=pd-vllm ... pd_one`): "
          "`pdserve serve --prefill 1 --decode 1` (cuda_ipc) against vLLM with NixlConnector behind the anchors' proxy; "
          "dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both, one round:\n")
    print("| workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean TPOT vLLM "
          "/ pdserve ms | ratio |\n|---|---|---|---|---|---|---|---|")
    pairs = {}
    for w in ("1024x1024_c256", "8192x16_c1"):
        v, p = (load(f"{base}/pd/pd-{n}/{n}_pd_{w}.json") for n in ("vllm", "pdserve"))
        pairs[w] = (v, p)
        print(f"| {w} | {_sbs_cells(v, p)}")
    v, p = pairs["1024x1024_c256"]
    vs, ps = (load(f"{base}/pd/pd-{m}/{m}_pd_server.json") for m in ("vllm", "pdserve"))
    comp = ", ".join(f"{n} {_compiles(f'{base}/pd/pd-pdserve/pdlogs/{n}0.log.gz')}" for n in ("prefill", "decode"))
    ratio = p["output_throughput"] / v["output_throughput"]
    print("\n- requests completed: " + ", ".join(f"{w} vLLM {a['completed']}, pdserve {b['completed']}"
                                                   for w, (a, b) in pairs.items())
          + f"; 1024x1024_c256 inter-token latency median / p99: vLLM {v['median_itl_ms']:.1f} / {v['p99_itl_ms']:.1f} "
          f"ms, pdserve {p['median_itl_ms']:.1f} / {p['p99_itl_ms']:.1f} ms")
    print(f"- start-up (launch to first completion through the proxy or router): vLLM {vs['startup_s']:.1f} s, pdserve "
          f"{ps['startup_s']:.1f} s; KV tokens vLLM {vs['kv_tokens']:,}, pdserve {ps['kv_tokens']:,}; kernels "
          f"pdserve's instances compiled while serving: {comp}")
    s33 = [load(f"lease_s33/pd_r{r}/pd-pdserve/pdserve_pd_1024x1024_c256.json")["output_throughput"]
           / load(f"lease_s33/pd_r{r}/pd-vllm/vllm_pd_1024x1024_c256.json")["output_throughput"] for r in (1, 2)]
    print(f"- issue 10's PD criterion, 1024/1024 c256 output: {ratio:.3f}x vLLM's 1P1D (>= 1.0: "
          f"{'met' if ratio >= 1.0 else 'not met'}); session 33's two rounds at its tree: "
          + " and ".join(f"{x:.3f}x" for x in s33))


def session41() -> None:
    """Session 41 (one H200 lease, four machines: the decode kernel's GPU tests after session 40's removal, its
    steps and loops, dummy Qwen3-8B beside vLLM at the session's tree, whether a product hides under the batch-256
    decode attention, and the mixed steps)."""
    base = "lease_s41"

    def met(x: float, bound: float, le: bool = True) -> str:
        return "met" if (x <= bound if le else x >= bound) else "not met"

    dots = (B / f"{base}/s41a/gpu_tests.txt").read_text()
    print(f"- the decode kernel's GPU tests after session 40 removed its losing switches (s41a, machine 1, "
          f"`lease_1gpu.sh s41a`: test_attention_decode.py, test_cuda_graphs.py, test_vs_transformers.py, "
          f"test_async_gpu.py): {dots.count('.')} passed and {dots.count('F')} failed before its 330-s limit stopped "
          f"pytest in test_cuda_graphs.py; the 12 left (s41b, machine 2, `lease_1gpu.sh s41b`): "
          f"`{_gpu_tests(f'{base}/s41b/gpu_tests.txt')}`")
    d = load(f"{base}/s41a/steps.json")
    print(f"\nDummy Qwen3-8B's decode steps and steady loops at the session's tree (s41a; --iters {d['args']['iters']}, "
          f"loops of {d['args']['loop_steps']} steps at temperature {d['args']['loop_temperature']}; same run: "
          f"{_ceilings(d['ceilings'])}):\n")
    _run_table(d, serial=True)
    loops = {lp["case"]: lp for lp in d["loops"] if lp["async"]}
    b1, b256 = loops["loop:1x1024"]["fraction_of_floor"], loops["loop:256x1024"]["fraction_of_floor"]
    print(f"\n- issue 10's engine criteria: steady decode at batch 1 {b1:.3f} of its floor (>= 0.8: "
          f"{met(b1, 0.8, False)}), at batch 256 {b256:.3f} (>= 0.8: {met(b256, 0.8, False)}"
          f"; {loops['loop:256x1024']['fraction_of_serial_bound']:.3f} of its serial bound)")
    lp = loops["loop:256x1024"]
    bound = lp["step_ms"] * lp["fraction_of_serial_bound"]
    print(f"- the batch-256 loop: 80 % of its floor is {lp['floor_ms'] / 0.8:.2f} ms a step, against {lp['step_ms']:.2f} ms "
          f"({lp['step_ms'] - lp['floor_ms'] / 0.8:.2f} ms to go); its serial bound {bound:.2f} ms, at which a step "
          f"would be at {lp['floor_ms'] / bound:.0%} of its floor; the loop spends {lp['step_ms'] - bound:.2f} ms beyond it")

    folder = f"{base}/dense"
    print(f"\nDummy Qwen3-8B (bf16) beside vLLM 0.22 at the session's tree (machine 2, after s41b: vLLM staged in eleven "
          f"calls, `lease_2xh200.sh unpack`, then `SBS_WORKLOADS=\"1024:1024:512:256 8192:16:16:1 32768:16:8:1\" "
          f"lease_1gpu.sh dense`: vLLM then pdserve on the one GPU, vLLM's `bench serve` for both; kernels pdserve "
          f"compiled while serving: "
          f"{gzip.decompress((B / f'{folder}/pdserve.log.gz').read_bytes()).decode().count('compiled a kernel while serving')}"
          f"):\n")
    _sbs_table(folder)
    print("\nThe servers' own means over the same runs:\n")
    _server_side(folder)
    print()
    _sbs_chunks(folder, "32768x16_c1")
    _sbs_chunks(folder, "8192x16_c1")
    before = {w["workload"]: w["ratio"] for f in ("lease_s34/s34b/sbs", "lease_s35/s35a/sbs")
              for w in load(f"{f}/comparison.json")["workloads"]}
    r = {w["workload"]: w["ratio"] for w in load(f"{folder}/comparison.json")["workloads"]}
    c256, k8, k32 = r["1024x1024_c256"], r["8192x16_c1"], r["32768x16_c1"]
    print("\n- against the last dense runs (1024/1024 c256: session 34's s34b, one GPU; 8k and 32k: session 35's s35a): "
          + "; ".join(f"{k} output {r[k]['output_throughput']:.3f}x ({before[k]['output_throughput']:.3f}x), mean TTFT "
                      f"{r[k]['mean_ttft']:.3f} ({before[k]['mean_ttft']:.3f})" for k in sorted(r)))

    v, p = (load(f"{folder}/{n}_single_server.json") for n in ("vllm", "pdserve"))
    print(f"- issue 10, by vLLM's client: 1024/1024 c256 output {c256['output_throughput']:.3f}x (>= 1.0: "
          f"{met(c256['output_throughput'], 1.0, False)}; aim 1.15: {met(c256['output_throughput'], 1.15, False)}), "
          f"mean TPOT {c256['mean_tpot']:.3f} (<= 1: {met(c256['mean_tpot'], 1.0)}), mean TTFT {c256['mean_ttft']:.3f} "
          f"(<= 1: {met(c256['mean_ttft'], 1.0)}); 8192/16 TTFT {k8['mean_ttft']:.3f} (<= 1: {met(k8['mean_ttft'], 1.0)}), "
          f"TPOT {k8['mean_tpot']:.3f} (<= 1.1: {met(k8['mean_tpot'], 1.1)}); 32768/16 TTFT {k32['mean_ttft']:.3f} "
          f"(<= 1: {met(k32['mean_ttft'], 1.0)}), TPOT {k32['mean_tpot']:.3f} (<= 1.1: {met(k32['mean_tpot'], 1.1)}; "
          f"by the servers' own inter-token latency {k32['server_itl']:.3f}); KV tokens "
          f"{p['kv_tokens'] / v['kv_tokens']:.4f}x (>= 1: {met(p['kv_tokens'] / v['kv_tokens'], 1.0, False)}); "
          f"start-up {p['startup_s'] / v['startup_s']:.3f}x (<= 1: {met(p['startup_s'] / v['startup_s'], 1.0)})")

    o = load(f"{base}/s41d/overlap.json")
    print(f"\nCan a product hide under the batch-256 decode attention? (s41d, machine 3, `lease_1gpu.sh s41d`: "
          f"benchmarks/attention/probe_overlap.py, {o['args']['batch']} rows x {o['args']['context']} keys, "
          f"{o['args']['layers']} layers cycled, each with its own KV and weights; the product at 256 rows on a second "
          f"stream, forked and joined each layer; same run: HBM copy {o['ceilings']['hbm_copy_gbps']:,.0f} GB/s, bf16 "
          f"matmul {o['ceilings']['matmul_tflops']:.0f} TFLOP/s), us a layer:\n")
    print("| launch | arm | stream | launched first | us a layer | of the product hidden |\n|---|---|---|---|---|---|")
    for row in o["rows"]:
        hid = f"{row['hidden_of_product']:.0%}" if "hidden_of_product" in row else ""
        print(f"| {row['how']} | {row['arm'].replace(' || ', ' beside ')} | {row.get('stream', '')} | "
              f"{row.get('first', '')} | {row['us']:.1f} | {hid} |")
    g = [x for x in o["rows"] if x["how"] == "graph" and "hidden_of_product" in x]
    span = {k: [x["hidden_of_product"] for x in g if x["arm"].endswith(f"|| {k}")] for k in ("o", "gate_up")}
    print("\n- in a CUDA graph, as the engine runs a step, the share of the product's own time that running both at once "
          "saved against one after the other: " + ", ".join(f"{k} {min(v):.0%} to {max(v):.0%}" for k, v in span.items()))
    d = load(f"{base}/s41e/steps.json")
    print(f"\nDummy Qwen3-8B's mixed steps (256 decode rows at 1024 tokens of context and a prompt's chunk) at the session's "
          f"tree (s41e, machine 4, `lease_1gpu.sh s41e`; each step run and waited for, so its time includes the host's "
          f"preparation of it; same run: {_ceilings(d['ceilings'])}):\n")
    _run_table(d, serial=True)
    pj = load(f"{base}/s41e/profile.json")
    print(f"\nThe same steps under the profiler (the same call, {pj['args']['profile_steps']} steps each, run and waited "
          f"for; each on the path the table names):\n")
    print("| step | kernels a step | kernel ms a step | GPU busy ms | GPU idle ms | its longest idle gaps |\n"
          "|---|---|---|---|---|---|")
    for prof in pj["profiles"]:
        g = prof["graphs"]
        gaps = "; ".join(f"{x['us']:.0f} us after {x['after'][:32]} before {x['before'][:32]}"
                         for x in g["gpu"]["longest_gaps"])
        print(f"| {prof['case']} | {g['kernels_per_step']:.0f} | {g['gpu_us_per_step'] / 1e3:.2f} | "
              f"{g['gpu']['busy_us_per_step'] / 1e3:.2f} | {g['gpu']['idle_us_per_step'] / 1e3:.2f} | {gaps} |")


def session40() -> None:
    """Session 40 (one H200 lease, one machine: the three prefill A/Bs session 39 wrote)."""
    base = "lease_s40"
    print(f"- wide QK-norm + rotary programs (s40a, `lease_1gpu.sh s40a`): tests/ops/test_rotary.py's GPU tests "
          f"`{_gpu_tests(f'{base}/s40a/gpu_tests.txt')}` (the failures: test_wide_programs_change_no_byte_cuda, "
          f"wide programs' bytes not equal to the narrow ones)")
    print("\nDummy Qwen3-30B-A3B (fp8 KV) prefill steps with programs of at most 512 elements (w0, as shipped), 1024 and "
          "2048 in steps of 1024 tokens or more (`--rope-wide-tile`), one process an arm:\n")
    arms = ["moe_w0", "moe_w1024", "moe_w2048"] * 2
    t = _arm_deltas(_arms_table(f"{base}/s40a", arms), arms, "moe_w0", ["prefill:8192", "prefill:24576+8192"])
    print(f"\n- against w0, the mean of each arm's two: {t}")
    print("\nDummy Qwen3-8B, the same call:\n")
    arms = ["8b_w0", "8b_w2048"] * 2
    t = _arm_deltas(_arms_table(f"{base}/s40a", arms, 7), arms, "8b_w0", ["prefill:8192"])
    print(f"\n- against w0: {t}; removed (no faster, and not bitwise equal on the GPU)")
    tune = (B / f"{base}/s40b/tune.txt").read_text().splitlines()
    print("\nThe fused MoE's tiles for 8192- and 16384-token steps (s40b, `lease_1gpu.sh s40b`: tune_fused_moe.py "
          "--tokens 8192 16384 merged into a copy of the H200 table); the tuner's own lines:\n")
    for ln in tune:
        if ln.startswith("T=") and "tuned" in ln:
            print(f"- `{ln.split(':')[0]}`: {ln[ln.index('tuned'):]}")
    print("\nDummy Qwen3-30B-A3B (fp8 KV) prefill steps with the shipped table (old) and the merged one (new):\n")
    arms = ["old", "new"] * 2
    t = _arm_deltas(_arms_table(f"{base}/s40b", arms), arms, "old", ["prefill:8192", "prefill:24576+8192"])
    print(f"\n- against old, the mean of each arm's two: {t}; the table not changed")
    print(f"\ncuDNN's inputs that need no padding as views of the step's fused q/k/v (s40c, `lease_1gpu.sh s40c`): GPU "
          f"tests (test_library_prefill.py, the warm-up's no-new-plan test, both with it on and off) "
          f"`{_gpu_tests(f'{base}/s40c/gpu_tests.txt')}`; prefill steps without it (off: `--no-library-strided-inputs`) "
          f"and with it (on), one process an arm; dummy Qwen3-30B-A3B (fp8 KV):\n")
    cases = ["prefill:8192", "prefill:8192+8192", "prefill:24576+8192"]
    for model, first in (("moe", 1), ("8b", 5)):
        if model == "8b":
            print("\nDummy Qwen3-8B:\n")
        arms = [f"{model}_off", f"{model}_on"] * 2
        times = _arms_table(f"{base}/s40c", arms, first)
        t = _arm_deltas(times, arms, f"{model}_off", cases)
        ratio = {n: sum(v[1::2]) / sum(v[0::2]) for n, v in times.items()}
        print(f"\n- on against off, the mean of each arm's two: {t}; on / off: "
              + ", ".join(f"{n} {r:.3f}" for n, r in ratio.items()))

    print(f"\nAt session 40's defaults (s40d, a second machine, `lease_1gpu.sh s40d`): GPU tests (test_library_prefill.py, "
          f"test_warmup.py, test_memory_profile.py, test_rotary.py) `{_gpu_tests(f'{base}/s40d/gpu_tests.txt')}`; the "
          f"kernels of dummy Qwen3-30B-A3B's (fp8 KV) fresh 8192-token prompt, against session 39's at its defaults "
          f"(lease_s39/s39d, another machine):\n")
    profs = [load(f)["profiles"][0]["graphs"] for f in ("lease_s39/s39d/profile.json", f"{base}/s40d/profile.json")]
    times = [{t["name"]: (t["count_per_step"], t["us_per_step"]) for t in g["top"]} for g in profs]
    print("| kernel | session 39 (packed inputs) | session 40 (views) |\n|---|---|---|")
    for name in [t["name"] for t in profs[0]["top"][:10]]:
        print(f"| {name[:60]} | " + " | ".join(
            f"{x[name][1] / 1e3:.1f} ms ({x[name][0]:.0f} calls)" if name in x else "-" for x in times) + " |")
    print("| all kernels | " + " | ".join(f"{g['gpu_us_per_step'] / 1e3:.1f} ms ({g['kernels_per_step']:.0f} kernels)"
                                         for g in profs) + " |")

    d = load(f"{base}/s40e/steps.json")
    print(f"\nThe engine microbenchmark's criteria at session 40's tree (s40e, a third machine, `lease_1gpu.sh s40e`: "
          f"dummy Qwen3-8B, --iters {d['args']['iters']}, loops of {d['args']['loop_steps']} steps at temperature "
          f"{d['args']['loop_temperature']}; same run: {_ceilings(d['ceilings'])}):\n")
    _run_table(d, serial=True)
    pf = next(r for r in d["results"] if r["case"] == "prefill:8192")
    loops = {lp["case"]: lp for lp in d["loops"] if lp["async"]}
    met = {k: "met" if x >= b else "not met" for k, x, b in (
        ("pf", pf["fraction_of_floor"], 0.75), ("b1", loops["loop:1x1024"]["fraction_of_floor"], 0.8),
        ("b256", loops["loop:256x1024"]["fraction_of_floor"], 0.8))}
    print(f"\n- issue 10's engine criteria: prefill of 8k tokens {pf['fraction_of_floor']:.3f} of the matmul ceiling "
          f"(>= 0.75: {met['pf']}); steady decode at batch 1 {loops['loop:1x1024']['fraction_of_floor']:.3f} of its "
          f"floor (>= 0.8: {met['b1']}), at batch 256 {loops['loop:256x1024']['fraction_of_floor']:.3f} "
          f"(>= 0.8: {met['b256']})")


def session39() -> None:
    """Session 39 (one H200 lease, two machines: long prefill rows over an fp8 pool through cuDNN, A/B'd, served
    beside vLLM, shipped on, and its GPU tests)."""
    base = "lease_s39"
    print(f"- the library's GPU tests with fp8 pools through cuDNN (s39a, machine 1, `lease_1gpu.sh s39a`): "
          f"`{_gpu_tests(f'{base}/s39a/gpu_tests.txt')}`")
    print("\nDummy Qwen3-30B-A3B (fp8 KV, `--max-model-len 40960`): a fresh 8192-token prompt and the 8192-token chunk "
          "on a 24576-token prefix, with the Triton prefill kernel over the fp8 pool (off: `--no-library-fp8-pools`) "
          "and through cuDNN with the prefix dequantized as it is gathered (on: `--library-fp8-pools`), one process an "
          "arm (s39a):\n")
    arms = ["off", "on", "off", "on"]
    times = _arms_table(f"{base}/s39a", arms)
    t = _arm_deltas(times, arms, "off", ["prefill:8192", "prefill:24576+8192"])
    ratio = {n: (sum(v[1::2]) / sum(v[0::2])) for n, v in times.items()}
    print(f"\n- on against off, the mean of each arm's two: {t}; on / off: "
          + ", ".join(f"{n} {r:.3f}" for n, r in ratio.items()))
    print("\nDummy Qwen3-30B-A3B beside vLLM with it on (moe/, machine 1 after s39a: eleven staging calls, "
          "`lease_2xh200.sh unpack`, then `PDSERVE_PREFILL_LIBRARY_FP8=1 SBS_WORKLOADS=\"8192:16:16:1 32768:16:8:1\" "
          "lease_1gpu.sh moe`, `--kv-cache-dtype fp8` on both, vLLM's client):\n")
    _sbs_table(f"{base}/moe")
    print("\nThe servers' own means over the same runs:\n")
    _server_side(f"{base}/moe")
    print()
    for name in ("8192x16_c1", "32768x16_c1"):
        vj, pj = (load(f"{base}/moe/{n}_single_{name}.json") for n in ("vllm", "pdserve"))
        vb = load(f"lease_s38/moe/vllm_single_{name}.json")
        pb = load(f"lease_s38/moe2/pdserve_single_{name}.json")
        print(f"- {name}: mean TTFT {pj['mean_ttft_ms'] / vj['mean_ttft_ms']:.3f}x vLLM's, median "
              f"{pj['median_ttft_ms'] / vj['median_ttft_ms']:.3f}x, p90 {pj['p90_ttft_ms'] / vj['p90_ttft_ms']:.3f}x "
              f"(session 38, the Triton kernel over the fp8 pool: mean {pb['mean_ttft_ms'] / vb['mean_ttft_ms']:.3f}x, "
              f"median {pb['median_ttft_ms'] / vb['median_ttft_ms']:.3f}x)")
    miss = sum("compiled a kernel while serving" in ln for ln in gzip.decompress(
        (B / f"{base}/moe/pdserve.log.gz").read_bytes()).decode(errors="replace").splitlines())
    print(f"- kernels pdserve compiled while serving: {miss}")
    print(f"\nShipped on (library_prefill.FP8_POOLS). GPU tests at that default (s39b, machine 2, `lease_1gpu.sh s39b`, "
          f"and s39c, the same machine, the tests s39b's limits cut): the library's, the warm-up's and the KV sizing's "
          f"(now also over an fp8 pool, and a whole engine over one with long prompts against the Triton kernel's "
          f"logits): `{_gpu_tests(f'{base}/s39b/gpu_tests_library.txt')}`")
    dots = [(B / f"{base}/s39b/{f}").read_text() for f in ("gpu_tests_fp8.txt", "moe_gpu_tests.txt")]
    print(f"- the other fp8 GPU tests (`-k fp8`) and the 41 MoE GPU tests s38a's cut left unrun: {dots[0].count('.')} "
          f"and {dots[1].count('.')} passes, {dots[0].count('F') + dots[1].count('F')} failures before s39b's limits "
          f"cut them; the rest (s39c): `{_gpu_tests(f'{base}/s39c/gpu_tests.txt')}`")
    print("\nWhere the MoE's prefill goes at that default (s39d, machine 3, `lease_1gpu.sh s39d`: `bench_steps.py --model "
          "qwen3-30b-a3b --kv-cache-dtype fp8 --profile`), each kernel's time a step:\n")
    print("| kernel | " + " | ".join(p["case"] for p in load(f"{base}/s39d/profile.json")["profiles"]) + " |\n|---|---|---|")
    profs = [p["graphs"] for p in load(f"{base}/s39d/profile.json")["profiles"]]
    times = [{t["name"]: (t["count_per_step"], t["us_per_step"]) for t in g["top"]} for g in profs]
    for name in [t["name"] for t in profs[0]["top"][:9]]:
        print(f"| {name[:60]} | " + " | ".join(
            f"{x[name][1] / 1e3:.1f} ms ({x[name][0]:.0f} calls)" if name in x else "-" for x in times) + " |")
    print("| all kernels | " + " | ".join(f"{g['gpu_us_per_step'] / 1e3:.1f} ms" for g in profs) + " |")


def session38() -> None:
    """Session 38 (one H200: session 37's three stages, the MoE side by side with 8k and 32k prompts, and where the
    MoE's 32k prefill goes on an fp8 pool)."""
    base = "lease_s38"
    dots = (B / f"{base}/s38a/moe_gpu_tests.txt").read_text()
    print(f"- MoE GPU tests at session 37's defaults (s38a, `lease_1gpu.sh s38a`: test_qwen3_moe_vs_transformers.py and "
          f"test_fused_moe_kernel.py under `timeout 330`): {dots.count('.')} passes and {dots.count('F')} failures "
          f"before the cut, among them the 30B sparse-block test session 37 fixed (collected 4th-11th)")
    d = load(f"{base}/s38a/steps.json")
    print("- dummy Qwen3-8B, the same call (async loops at temperature 1): " + "; ".join(
        f"{x['case']} {x['step_ms']:.2f} ms a step ({x['floor_ms'] / x['step_ms']:.0%} of its floor, "
        f"{x['floor_ms']:.2f} ms)" for x in d["loops"] if x["async"]))
    print("\nA sparse block's router product through the skinny kernel (model.moe.ROUTER_SKINNY; s38b): GPU tests "
          f"`{_gpu_tests(f'{base}/s38b/gpu_tests.txt')}`; dummy Qwen3-30B-A3B (fp8 KV) without it (off) and with it "
          "(on), one process an arm:\n")
    arms = ["off", "on", "off", "on"]
    t = _arm_deltas(_arms_table(f"{base}/s38b", arms), arms, "off",
                    ["decode:4x1024", "loop:1x1024", "loop:1x8192"])
    print(f"\n- on against off, the mean of each arm's two: {t}; shipped on")
    print("\nThe MoE's batch-1 decode splits (s38c): the shipped rule (base: at least 64 keys a split) against at "
          "least 256 and 512 (`--min-split-keys`):\n")
    arms = ["base", "k256", "k512", "base", "k256", "k512"]
    t = _arm_deltas(_arms_table(f"{base}/s38c", arms), arms, "base", ["loop:1x1024", "loop:1x8192", "decode:1x8192"])
    print(f"\n- against base, the mean of each arm's two: {t}; not changed")
    print("\nDummy Qwen3-30B-A3B beside vLLM at the shipped code (moe/: eleven staging calls, `lease_2xh200.sh unpack`, "
          "then `SBS_WORKLOADS=\"1024:1024:512:256 8192:16:16:1 32768:16:8:1\" lease_1gpu.sh moe`, `--kv-cache-dtype "
          "fp8` on both, vLLM's client; the stage's limit cut pdserve's 8k and 32k runs, which moe2/ ran next on the "
          "same machine, pdserve alone):\n")
    c = load(f"{base}/moe/comparison.json")
    print("| workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean TPOT "
          "vLLM / pdserve ms | ratio | median TTFT vLLM / pdserve ms | server TTFT vLLM / pdserve ms | server "
          "inter-token vLLM / pdserve ms |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for w in sorted(c["workloads"], key=lambda w: w["workload"]):
        name = w["workload"]
        vj = load(f"{base}/moe/vllm_single_{name}.json")
        pdir = "moe" if name.startswith("1024x") else "moe2"
        pj = load(f"{base}/{pdir}/pdserve_single_{name}.json")
        vs = load(f"{base}/moe/vllm_single_{name}.server.json")
        ps = load(f"{base}/{pdir}/pdserve_single_{name}.server.json")
        print(f"| {name}{'' if pdir == 'moe' else ' (pdserve: moe2)'} | {_sbs_cells(vj, pj)} "
              f"{vj['median_ttft_ms']:.1f} / {pj['median_ttft_ms']:.1f} | {vs['ttft']['mean_ms']:.1f} / "
              f"{ps['ttft']['mean_ms']:.1f} | {vs['itl']['mean_ms']:.2f} / {ps['itl']['mean_ms']:.2f} |")
    v, p = (load(f"{base}/moe/{n}_single_server.json") for n in ("vllm", "pdserve"))
    p2 = load(f"{base}/moe2/pdserve_single_server.json")
    print(f"\nKV tokens: vLLM {v['kv_tokens']:,}, pdserve {p['kv_tokens']:,} ({p['kv_tokens'] / v['kv_tokens']:.4f}x); "
          f"start-up (launch to first completion): vLLM {v['startup_s']:.1f} s, pdserve {p['startup_s']:.1f} s (the "
          f"machine's first pdserve start: Triton's cache empty; moe2's, after it: {p2['startup_s']:.1f} s)")
    miss = sum("compiled a kernel while serving" in ln for f in ("moe", "moe2") for ln in gzip.decompress(
        (B / f"{base}/{f}/pdserve.log.gz").read_bytes()).decode(errors="replace").splitlines())
    print(f"- kernels pdserve compiled while serving: {miss}")
    print("- the servers' TTFT clocks: vLLM's from its renderer's arrival_time (before tokenizing); pdserve's, in this "
          "tree, from its body read (before tokenizing; until this session after it)")
    prof = load(f"{base}/p32/fp8_profile.json")["profiles"][0]["graphs"]
    bf = load(f"{base}/p32/bf16.json")
    r = bf["results"][0]
    kern = next(t for t in prof["top"] if t["name"] == "_prefill_kernel")
    rate = bf["ceilings"]["bf16_matmul_tflops"]
    print(f"\nWhere the MoE's 32k prefill goes (p32, the same machine after moe2): dummy Qwen3-30B-A3B's last 8192-token "
          f"chunk on a 24576-token prefix (`bench_steps.py --prefill 24576+8192`). With an fp8 pool, under the profiler "
          f"(`--kv-cache-dtype fp8 --profile`): {prof['gpu_us_per_step'] / 1e3:.1f} ms of kernel time a step, the Triton "
          f"prefill kernel {kern['us_per_step'] / 1e3:.1f} ms of it ({kern['share']:.0%}) over {kern['count_per_step']:.0f} "
          f"layers: the chunk's {r['attn_flops'] / 1e12:.0f} TFLOP of attention at "
          f"{r['attn_flops'] / kern['us_per_step'] / 1e6:.0f} TFLOP/s. With a bf16 pool (cuDNN's attention, "
          f"library_prefill.py), timed: {r['step_ms_median']:.1f} ms the whole step ({r['fraction_of_floor']:.0%} of "
          f"its compute floor, {r['floor_ms']:.1f} ms at the run's {rate:.0f} TFLOP/s)")
    top = [f"{t['name'][:40]} {t['us_per_step'] / 1e3:.1f} ms" for t in prof["top"][:6]]
    print(f"- the fp8 step's largest kernels a step: {', '.join(top)}")


def session37() -> None:
    """Session 37 (two H200 machines: the fp8/MoE A/Bs session 36 wrote, shipped; the MoE side by side at them)."""
    base = "lease_s37"
    print(f"- GPU tests (s37a, machine 1, `lease_1gpu.sh s37a`): the warm-up's burst test on dummy Qwen3-0.6B and on "
          f"dummy Qwen3-30B-A3B with an fp8 pool (after session 36's warm-up step: nothing compiled by the burst), fp8 "
          f"KV's GPU tests, the decode kernel's fp8 ones: `{_gpu_tests(f'{base}/s37a/gpu_tests.txt')}`")
    print("\nDummy Qwen3-30B-A3B (fp8 KV, temperature 1, async loops) with V widened by PTX in the few-row launches "
          "too (wf: `--decode-fp8-v-widen-few`) and with the rotary in the fp8 decode kernel besides (wfr: also "
          "`--decode-rope-fp8`), against neither (off), one process an arm (s37b, machine 1, `lease_1gpu.sh s37b`):\n")
    arms = ["off", "wf", "wfr", "off", "wf", "wfr"]
    t = _arm_deltas(_arms_table(f"{base}/s37b", arms), arms, "off", ["loop:1x1024", "loop:1x8192", "decode:32x4096"])
    print(f"\n- against off, the mean of each arm's two: {t}")
    print("- the rotary's 32-row step is slower: there the launch takes the (128, 4, 3) tile; shipped: V by PTX in every "
          "fp8 launch (decode.FP8_V_WIDEN_FEW), the rotary in the fp8 decode kernel only where the tile has at most 64 "
          "keys, i.e. below 8 rows (decode.ROPE_IN_DECODE_FP8, ROPE_FP8_MAX_KEYS)")
    print(f"\nA MoE layer's experts summed by the next add+RMSNorm (model.moe.SUM_IN_NORM; s37c, machine 1): GPU tests "
          f"`{_gpu_tests(f'{base}/s37c/gpu_tests.txt')}`; the steps and loops without it (off) and with it (on):\n")
    arms = ["off", "on", "off", "on"]
    t = _arm_deltas(_arms_table(f"{base}/s37c", arms), arms, "off", ["loop:1x1024", "loop:256x1024"])
    print(f"\n- on against off, the mean of each arm's two: {t}; shipped on")
    print(f"\nThe three together as shipped (new) against none of them (old: `--no-decode-fp8-v-widen-few "
          f"--no-decode-rope-fp8 --no-moe-sum-in-norm`) (s37d, machine 2, `lease_1gpu.sh s37d`; first its GPU tests: "
          f"the burst tests, the fp8 rotary and V-by-PTX tests at the new defaults, "
          f"`{_gpu_tests(f'{base}/s37d/gpu_tests.txt')}`):\n")
    arms = ["old", "new", "old", "new"]
    times = _arms_table(f"{base}/s37d", arms)
    t = _arm_deltas(times, arms, "old", ["loop:1x1024", "loop:1x8192", "loop:256x1024"])
    print(f"\n- new against old, the mean of each arm's two: {t}")
    print("\nThe MoE side by side at the shipped code (moe/, machine 2 after s37d: eleven staging calls, "
          "`lease_2xh200.sh unpack`, then `SBS_WORKLOADS=\"1024:1024:512:256\" lease_1gpu.sh moe`: vLLM (FLASH_ATTN) "
          "then pdserve, `--kv-cache-dtype fp8` on both, vLLM's client):\n")
    lines = _moe_sbs(f"{base}/moe", "lease_s36/moe", "session 36: ")
    miss = [ln for ln in lines if "compiled a kernel while serving" in ln]
    print(f"- kernels pdserve compiled while serving: {len(miss)}")
    dots = (B / f"{base}/s37e/moe_gpu_tests.txt").read_text().strip()
    print(f"\n- MoE GPU tests at the new defaults (s37e, machine 2, the last of the device budget): the MoE models "
          f"against transformers on CUDA, `{_gpu_tests(f'{base}/s37e/moe_cuda_tests.txt')}`; "
          f"test_qwen3_moe_vs_transformers.py and test_fused_moe_kernel.py under `timeout 170`: cut before the summary "
          f"after {dots.count('.')} passes and {dots.count('F')} failures, the failures the eight cases of "
          f"test_sparse_block_at_qwen3_30b_shapes_matches_transformers (the {dots.index('F') + 1}th-{dots.rindex('F') + 1}th "
          f"collected), which called `.float()` "
          f"on the block's output, now PartialSums (the test sums them as the norm does since; not re-run on a GPU)")


def session36() -> None:
    """Session 36 (three H200 machines one after the other: the fp8 pool's decode kernel at the MoE's heads, swept
    and in the engine; the MoE side by side at the shipped result)."""
    base = "lease_s36"
    print("The decode kernel on an fp8 pool at dummy Qwen3-30B-A3B's attention heads (32 query heads over 4 KV heads, "
          "d=128, e4m3, the engine's head-major pool, 12 layers cycled in a CUDA graph), us a layer and its share of "
          "the HBM copy rate measured in the same run. s36b (machine 1, `lease_1gpu.sh s36b`): each tile of the sweep "
          "with the block table read a tile ahead and without; s36d (machine 2, `lease_1gpu.sh s36d`): with V widened "
          "to fp16 by the kernel's inline PTX (decode.FP8_V_WIDEN) and without:\n")
    for stage in ("s36b", "s36d"):
        rows = _sweep_rows(f"{base}/{stage}/sweep.json")
        hbm = load(f"{base}/{stage}/sweep.json")["ceilings"]["hbm_copy_gbps"]
        shapes = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda x: (-x[0], x[1]))
        table_tile = [128, 4, 3]
        print(f"{stage} (HBM copy {hbm:,.0f} GB/s):\n")
        print("| rows x keys | the table's (128, 4, 3) as it was | best read ahead | best read ahead, V by PTX |"
              "\n|---|---|---|---|")
        for b, c in shapes:
            mine = [r for r in rows if (r["batch"], r["context"]) == (b, c)]
            was = next(r for r in mine if r["tile"] == table_tile and not r["prefetch"] and not r.get("v_widen"))
            cells = [f"{was['us']:.1f} ({was['of_floor']:.1%})"]
            for vw in (False, True):
                pick = [r for r in mine if r["prefetch"] and bool(r.get("v_widen")) == vw]
                if pick:
                    r = min(pick, key=lambda r: r["us"])
                    cells.append(f"{r['us']:.1f} ({r['of_floor']:.1%}) {_sweep_variant(r)}")
                else:
                    cells.append("-")
            print(f"| {b} x {c} | " + " | ".join(cells) + " |")
        choice = (B / f"{base}/{stage}/" / ("fp8_many_tile.txt" if stage == "s36b" else "fp8_many.txt")).read_text()
        print(f"\n- {stage}'s choice over the shapes (the stage's own script, geometric mean, read ahead): "
              f"`{choice.strip()}`\n")
    print("- why V by PTX: Triton 3.6 widens an fp8 V tile written `.to(fp16)` after reading it out of shared memory "
          "as the PV product's operand, a byte at a time; widened by inline PTX it goes through shared memory as fp16 "
          "and comes out by ldmatrix. The decode kernel's variants for sm_90 at the MoE's GQA 8 on an e4m3 pool "
          "(`kernel_resources.py --only \"bf16/fp8e4nv d=128 g=8\" --fp8-v-widen off|on`, run on the development "
          "VM: ptxas, no GPU; ptxas/):\n")
    print("| variant | `.to`: registers, spilled bytes, one-byte shared loads in the PTX | V by PTX: the same |\n"
          "|---|---|---|")
    kr = {w: load(f"{base}/ptxas/fp8_g8_widen_{w}.json") for w in ("off", "on")}
    for a, b in zip(kr["off"], kr["on"]):
        if a["kernel"] != "decode":
            continue
        name = ("many-program tile" if a.get("many") else "few-row tile" if a.get("few") else "many-row tile") \
            + (", one split" if a["single"] else ", splits") + (", mixed" if a["mixed"] else "") \
            + (", the rotary in it (ROPE_IN_DECODE_FP8)" if a.get("rope") else "")
        print(f"| {name} | " + " | ".join(f"{r['registers']}, {r['spill_bytes']}, {r['b8_shared_loads']}"
                                           for r in (a, b)) + " |")
    print()
    print(f"- GPU tests: s36b, the decode kernel's (fp8 many-program tiles, the CUDA cases against the reference): "
          f"`{_gpu_tests(f'{base}/s36b/decode_tests.txt')}`; the MoE tests session 35's limit had cut off (row "
          f"grouping at 128 experts, the routing kernel, graph replay, shipped tables, the MoE model against "
          f"transformers on CUDA): `{_gpu_tests(f'{base}/s36b/moe_tests.txt')}`; s36d, V by PTX (e4m3 and e5m2, head "
          f"dims 128 and 256, a window, one row to 80, one split and several, decode-only and mixed, against the "
          f"`.to`'s output and the reference): `{_gpu_tests(f'{base}/s36d/decode_tests.txt')}`")

    print("\nDummy Qwen3-30B-A3B's batch-256 step and async loop (fp8 KV, temperature 1) as shipped before (off) and with "
          "s36d's choice (on: --many-programs-tile-fp8 and --decode-fp8-v-widen), one process an arm, same machine:\n")
    print("| step | off ms (of floor) | on ms (of floor) | on - off |\n|---|---|---|---|")
    arms = {a: load(f"{base}/s36d/steps_{i}_{a}.json") for i, a in ((1, "off"), (2, "on"))}

    def case(d: dict, name: str) -> dict:
        for r in d["results"]:
            if r["case"] == name:
                return {"ms": r["step_ms_median"], "floor": r["floor_ms"]}
        lp = next(x for x in d["loops"] if x["async"] and x["case"] == name)
        return {"ms": lp["step_ms"], "floor": lp["floor_ms"]}

    names = [r["case"] for r in arms["off"]["results"]] + [x["case"] for x in arms["off"]["loops"] if x["async"]]
    for n in names:
        o, q = case(arms["off"], n), case(arms["on"], n)
        print(f"| {n} | {o['ms']:.2f} ({o['floor'] / o['ms']:.0%}) | {q['ms']:.2f} ({q['floor'] / q['ms']:.0%}) | "
              f"{q['ms'] - o['ms']:+.2f} |")
    print("\n- shipped: decode.MANY_PROGRAMS_TILE_FP8 = (64, 4, 3) with the read ahead, FP8_V_WIDEN on in those "
          "launches; launches of a few rows keep the table's tiles and the `.to` (FP8_V_WIDEN_FEW off: below)")

    print("\nThe MoE side by side at the shipped code (moe/, machine 3, eleven staging calls then `lease_1gpu.sh s36e`: "
          "vLLM (FLASH_ATTN) then pdserve, `--kv-cache-dtype fp8` on both, vLLM's client):\n")
    lines = _moe_sbs(f"{base}/moe", "lease_s35/moe", "session 35, before the routing kernel and this: ")
    miss = [ln.split("did not cover it): ", 1)[-1] for ln in lines if "compiled a kernel while serving" in ln]
    at = next(i for i, ln in enumerate(lines) if "compiled a kernel while serving" in ln)
    after = next(ln for ln in lines[at:] if "running " in ln and "engine:" in ln)
    running = after.split("running ", 1)[1].split(",")[0]
    print(f"- kernels pdserve compiled while serving: {len(miss)}" + (f" ({'; '.join(miss)})" if miss else "")
          + f": by the time (the stats line after it: {running} running), a mixed step of two rows, which takes the few-row "
          "tile with several splits; the warm-up's 4-row mixed step, which compiled that before, now fills the waves "
          "of the many-program tile on this pool, so the warm-up plan gained a step of one row fewer than "
          "decode.many_program_split_rows (not yet run on a GPU)")

    rows = _sweep_rows(f"{base}/s36e/sweep_few.json")
    print("\nA few rows on the same pool (s36e, same machine, after the side by side; sweep_decode.py --v-widen "
          "--splits 0: the engine's split count; the table's tiles, no read ahead), us a layer (of the copy rate):\n")
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    tiles = sorted({tuple(r["tile"]) for r in rows})
    print("| rows x keys | " + " | ".join(f"{t} `.to` / V by PTX" for t in tiles) + " |\n|---|" + "---|" * len(tiles))
    for b, c in shapes:
        cells = []
        for t in tiles:
            v = {bool(r["v_widen"]): r for r in rows if (r["batch"], r["context"]) == (b, c) and tuple(r["tile"]) == t}
            cells.append(" / ".join(f"{v[w]['us']:.1f}" if w in v else "-" for w in (False, True)))
        print(f"| {b} x {c} | " + " | ".join(cells) + " |")
    pairs = [(v[False]["us"], v[True]["us"], sh, t) for sh in shapes for t in tiles
             for v in [{bool(r["v_widen"]): r for r in rows if (r["batch"], r["context"]) == sh
                        and tuple(r["tile"]) == t}] if len(v) == 2]
    slower = sorted({f"{t} at {b} x {c}" for a, w, (b, c), t in pairs if w > a})
    print(f"\n- V by PTX was faster at {sum(w < a for a, w, _, _ in pairs)} of these {len(pairs)} points, slower at "
          + ", ".join(slower) + " (the engine runs 4 x 8192 on the many-program tile: rows x KV heads x splits fill "
          "its waves); FP8_V_WIDEN_FEW stays off until a batch-1 loop measures it")
    print(f"- GPU tests at the shipped defaults (s36f, same machine, the decode kernel's and fp8 KV's GPU tests in one "
          f"call the device budget cut short): {(B / f'{base}/s36f/gpu_tests.txt').read_text().count('.')} "
          "passing, no failure (the decode kernel's CUDA cases, fp8 ones of 80 rows on the many-program tile with V "
          "by PTX among them; fp8 KV's file not reached)")


def session35() -> None:
    """Session 35 (machine 1, an H200: vLLM then pdserve at 8k/16 and 32k/16 one at a time with each server's own
    /metrics; the MoE side by side; dummy Qwen3-30B-A3B's steps and their kernels; machine 2, an H200: the MoE
    routing kernel and one-program row grouping)."""
    base = "lease_s35"
    print("vLLM 0.22, then pdserve, on one H200 (s35a: eleven staging calls, `lease_2xh200.sh unpack`, then "
          "`lease_1gpu.sh s35a`), dummy Qwen3-8B bf16, vLLM's client, one request at a time; each run between two "
          "scrapes of the server's /metrics:\n")
    _sbs_table(f"{base}/s35a/sbs")
    print("\nWhat each server measured of the same runs itself (server_latency.py over the two scrapes: vLLM times each "
          "token at its engine core's output, pdserve as its HTTP server takes the output; with 16 tokens every request, "
          "the mean inter-token latency is the mean of the requests' TPOTs). The servers' counts hold the client's two "
          "warm-up requests too, and the first request after them re-sends the warm-up prompt (a prefix-cache hit on "
          "both):\n")
    _server_side(f"{base}/s35a/sbs")
    c = load(f"{base}/s35a/sbs/comparison.json")
    w = {x["workload"]: x for x in c["workloads"]}
    print()
    for k in ("8192x16_c1", "32768x16_c1"):
        q = w[k]["ratio"]
        print(f"- {k.split('_')[0].replace('x', '/')} one at a time, batch-1 TPOT against vLLM's (issue 10 asks <= 1.1): "
              f"by vLLM's client {q['mean_tpot']:.3f} ({'met' if q['mean_tpot'] <= 1.1 else 'not met'}); by the "
              f"servers' own inter-token latency {q['server_itl']:.3f} ({'met' if q['server_itl'] <= 1.1 else 'not met'})"
              f"; mean TTFT by vLLM's client {q['mean_ttft']:.3f}, mean E2E {q['mean_e2el']:.3f}")
    for k in ("8192x16_c1", "32768x16_c1"):
        cells = []
        for n in ("vllm", "pdserve"):
            d = load(f"{base}/s35a/sbs/{n}_single_{k}.json")
            e2e = [t + sum(i) for t, i in zip(d["ttfts"][1:], d["itls"][1:])]
            itl = w[k][n]["server"]["itl"]["mean_ms"]
            made = [x * 1e3 - (d["output_lens"][0] - 1) * itl for x in e2e]
            cells.append((sum(e2e) / len(e2e) * 1e3, sum(made) / len(made)))
        print(f"- {k}, the {len(e2e)} requests after the prefix hit, by vLLM's client: mean E2E vLLM {cells[0][0]:.1f} / "
              f"pdserve {cells[1][0]:.1f} ms; less each server's own inter-token latency times the tokens after the "
              f"first (when each server's engine made its first token, on the client's clock): vLLM {cells[0][1]:.1f} / "
              f"pdserve {cells[1][1]:.1f} ms")
    print("- vLLM's client TTFT lies further past vLLM's own than its E2E does: vLLM's first chunk left the server later "
          "than vLLM's engine made the first token and carried the tokens made meanwhile; pdserve's two lie about "
          "equally far past its own (the request's way in: upload, parse, tokenize)")

    print("\nDummy Qwen3-30B-A3B with an fp8 KV cache, vLLM (FLASH_ATTN) then pdserve on the same H200 (moe/: "
          "`SBS_WORKLOADS=\"1024:1024:512:256 8192:16:16:1\" lease_1gpu.sh moe`), vLLM's client:\n")
    _sbs_table(f"{base}/moe")
    print("\nThe servers' own means over the same runs:\n")
    _server_side(f"{base}/moe")
    log = gzip.decompress((B / f"{base}/moe/pdserve.log.gz").read_bytes()).decode(errors="replace")
    print(f"\n- kernels pdserve compiled while serving: {log.count('compiled a kernel while serving')}")

    st = load(f"{base}/s35c/steps.json")
    print(f"\nThe same model's steps against their floors (s35c, same machine, `lease_1gpu.sh s35c`; each token's 8 "
          f"experts counted, a step's expert reads by its tokens' expected routing; {_ceilings(st['ceilings'])}):\n")
    _steps_bounds(f"{base}/s35c/steps.json")
    print("\nTheir kernels (s35d, same machine, `bench_steps.py --profile decode:RxC`, graphed steps). One row:\n")
    g1 = _profile_top(f"{base}/s35d/profile_1x1024.json", 20)
    print("\n256 rows:\n")
    g256 = _profile_top(f"{base}/s35d/profile_256x1024.json", 20)
    print()
    for label, g in (("one row", g1), ("256 rows", g256)):
        r = [t for t in g["top"] if any(k in t["name"] for k in ROUTE_KERNELS)]
        print(f"- {label}: the kernels only torch's routing and moe_align's three kernels launch ("
              + ", ".join(sorted({next(k for k in ROUTE_KERNELS if k in t['name']) for t in r}))
              + f"): {sum(t['marginal_us_per_step'] for t in r):.0f} us a step of marginal time in {sum(t['count_per_step'] for t in r):.0f} "
              "launches (the routing's sum, division and int32 copy are generic kernels and left out)")

    rt = load(f"{base}/s35e/route.json")
    print("\nA MoE layer's routing and row grouping one way against the other (s35e, machine 2, an H200, "
          "`bench_route.py`: 128 experts, top-8, bf16 logits, a CUDA graph of 48 calls replayed, us a call; BLOCK_M 16):\n")
    print("| tokens | routing: torch us | one Triton launch us | moe_align: three kernels us | one program us |\n"
          "|---|---|---|---|---|")
    for r in rt["results"]:
        one = f"{r['align_one_program_us']:.2f}" if "align_one_program_us" in r else "-"
        print(f"| {r['tokens']} | {r['route_torch_us']:.2f} | {r['route_triton_us']:.2f} | "
              f"{r['align_three_kernels_us']:.2f} | {one} |")
    print(f"\n- the largest weight difference between the two routings: {max(r['max_weight_err'] for r in rt['results']):.1e}; "
          f"tokens where the expert ids differed ({', '.join(str(r['tokens']) for r in rt['results'] if not r['same_ids'])}"
          "): bf16 logits tie, and a tie's order is open (the GPU test checks that the tied experts are the same)")
    print("- one program was faster up to 64 tokens and slower from 128: moe_align.ONE_PROGRAM_PAIRS set to 512 routed "
          "rows after this run (it ran at 2048)")
    print("\nDummy Qwen3-30B-A3B's steps (fp8 KV) with both (on) and with neither (off: `--no-moe-route-kernel "
          "--no-moe-align-one-program`), one process an arm, in order (s35e, the one-program limit at 2048 rows), ms a step:\n")
    arms = [("off", 1), ("on", 2), ("off", 3), ("on", 4)]
    data = {(a, i): load(f"{base}/s35e/steps_{i}_{a}.json") for a, i in arms}
    cases = [r["case"] for r in data[arms[0]]["results"]] + [
        lp["case"] for lp in data[arms[0]]["loops"] if lp["async"]]

    def ms(d: dict, case: str) -> float:
        for r in d["results"]:
            if r["case"] == case:
                return r["step_ms_median"]
        return next(lp["step_ms"] for lp in d["loops"] if lp["async"] and lp["case"] == case)

    print("| step | " + " | ".join(f"{a} ({i})" for a, i in arms) + " | on - off, mean of two each |\n|---|"
          + "---|" * (len(arms) + 1))
    for case in cases:
        v = {k: ms(d, case) for k, d in data.items()}
        diff = (v[("on", 2)] + v[("on", 4)] - v[("off", 1)] - v[("off", 3)]) / 2
        print(f"| {case} | " + " | ".join(f"{v[k]:.2f}" for k in arms) + f" | {diff:+.2f} |")
    lo = {a: load(f"{base}/s35f/loop_{a}.json") for a in ("on", "off")}
    l256 = {a: next(lp for lp in d["loops"] if lp["async"]) for a, d in lo.items()}
    print(f"\n- the batch-256 loop again with the one-program limit at 512 rows (s35f, the same machine; at 256 tokens "
          f"moe_align takes its three kernels): on {l256['on']['step_ms']:.2f}, off {l256['off']['step_ms']:.2f} ms a step "
          f"({l256['on']['step_ms'] - l256['off']['step_ms']:+.2f}); its floor {l256['on']['floor_ms']:.2f} ms "
          f"({l256['on']['fraction_of_floor']:.0%} on, {l256['off']['fraction_of_floor']:.0%} off)")
    print(f"- GPU tests: s35f (the routing kernel against softmax_topk at 1-4096 tokens, bf16/fp16/fp32, and the "
          f"fused MoE replayed in a CUDA graph for new routings): `{_gpu_tests(f'{base}/s35f/gpu_tests.txt')}`; s35e's "
          f"run of the align and MoE-model tests was stopped by its 240-s limit after "
          f"{(B / f'{base}/s35e/gpu_tests.txt').read_text().count('.')} passing tests and no failure (the CUDA "
          "align cases of 8 and 64 experts and the first of 128)")
    c256 = load(f"{base}/s35e/c256.json")
    slog = gzip.decompress((B / f"{base}/s35e/server.log.gz").read_bytes()).decode(errors="replace")
    print(f"- one `pdserve serve` of the model with both (s35e, the limit at 2048), pdserve's client at 1024/1024 c256: "
          f"{c256['output_throughput']:,.1f} out tok/s, mean TPOT {c256['mean_tpot_ms']:.2f} ms; kernels compiled "
          f"while serving: {slog.count('compiled a kernel while serving')}")


def session34() -> None:
    """Session 34 (machine 1, an H200: the engine's stats line under 1024/1024 c256 and bench_steps.py's defaults;
    machines 2 and 3, an H200 each: vLLM then pdserve at 1024/1024 c256 and the steps such a run is made of; each
    run against its serial bound). Machine 4's cut-off MoE call (moe_cut/) gave no ratio and is not printed."""
    base = "lease_s34"
    rb = _script("run_bound", "engine/run_bound.py")
    lines = _stats_lines(f"{base}/s34a/server.log.gz")
    first = next(i for i, x in enumerate(lines) if x["running"] + x["waiting"] >= 2)  # the client's run, not its warm-up
    last = max(i for i, x in enumerate(lines) if x["gen_tps"] > 0)
    busy = lines[first:last + 1]
    r = load(f"{base}/s34a/c256.json")
    print(f"The engine's stats line while serving (s34a, an H200; `pdserve serve` of dummy Qwen3-8B with "
          f"--log-stats-interval 2, pdserve's client at 1024/1024, 512 prompts at c256: {r['output_throughput']:,.1f} "
          f"out tok/s over {r['duration']:.2f} s, mean TPOT {r['mean_tpot_ms']:.2f} ms, p99 ITL {r['p99_itl_ms']:.1f} "
          f"ms), each 2-s interval from the first prompts to the last tokens:\n")
    print("| at | prompt tok/s | generation tok/s | steps/s | busy | ms a step | of it waiting for the GPU | running | "
          "waiting | KV cache used |\n|---|---|---|---|---|---|---|---|---|---|")
    for x in busy:
        print(f"| {x['time']} | {x['prompt_tps']:,.0f} | {x['gen_tps']:,.0f} | {x['steps_ps']:.1f} | {x['busy']:.0f}% | "
              f"{x['step_ms']:.1f} | {x['gpu_wait']:.0f}% | {x['running']:.0f} | {x['waiting']:.0f} | "
              f"{x['kv_used']:.1f}% |")
    dec = [x for x in busy if x["prompt_tps"] == 0 and x["running"] >= 255]
    pre = [x for x in busy if x["prompt_tps"] > 0]
    print(f"\n- intervals of pure decoding at 255-256 running ({len(dec)}): {min(x['step_ms'] for x in dec):.1f}-"
          f"{max(x['step_ms'] for x in dec):.1f} ms a step as the context grows, the engine busy "
          f"{min(x['busy'] for x in dec):.0f}-{max(x['busy'] for x in dec):.0f}% of the time and waiting for the GPU "
          f"{min(x['gpu_wait'] for x in dec):.0f}-{max(x['gpu_wait'] for x in dec):.0f}% of it: the host's share is "
          f"hidden under the step in flight, and the GPU sets the pace")
    print(f"- intervals with prompt tokens ({len(pre)}, both waves): {2 * len(pre)} s of the run")
    cpu = [re.match(r"(\d+) ([0-9.]+) CPU over the busy window \(peak ([0-9.]+)\): (\S+):", ln).groups()
           for ln in (B / f"{base}/s34a/timeline.txt").read_text().splitlines() if " CPU over " in ln]
    print("- CPU of the server's processes over the busy window (serve_timeline.py; pid, command: mean, peak): "
          + "; ".join(f"{pid} {cmd}: {c}, {pk}" for pid, c, pk, cmd in cpu)
          + " (the `pdserve serve` process serves HTTP; the engine runs in a spawned one)")
    print(f"\nbench_steps.py's default cases and loops in the same call (s34a; "
          f"{_ceilings(load(f'{base}/s34a/steps.json')['ceilings'])}), each against its floor and its serial bound:\n")
    _steps_bounds(f"{base}/s34a/steps.json")
    st = load(f"{base}/s34a/steps.json")
    e, c = st["engine"], st["ceilings"]
    hbm = c["hbm_copy_gbps"] * 1e6  # bytes a ms
    with gzip.open(B / f"{base}/s34a/server.log.gz", "rt") as f:
        blocks, bs = (int(x) for x in re.search(r"(\d+) KV blocks of (\d+) tokens", f.read()).groups())
    loop = next(lp for lp in st["loops"] if lp["async"] and lp["case"] == "loop:256x1024")
    late = dec[-1]
    points = [("the batch-256 loop", loop["rows_per_step"], loop["mean_context"], loop["step_ms"]),
              (f"serving at {late['time']}", late["running"], late["kv_used"] / 100 * blocks * bs / late["running"],
               1e3 / late["steps_ps"])]
    two = [(rows * (ctx + 1) * e["kv_bytes_per_token"] + 2 * e["weight_bytes_read"]) / hbm for _, rows, ctx, _ in points]
    print("\n- two micro-batches (one's products beside the other's attention) read the weights twice: the KV read plus "
          "two weights' reads at the copy rate against the measured step, " + "; ".join(
              f"{name} ({rows:.0f} rows, ~{ctx:.0f} tokens of context): {t:.2f} against {ms:.2f} ms"
              for (name, rows, ctx, ms), t in zip(points, two)))
    for call, machine in (("s34b", "another H200"), ("s34b_r2", "a third H200, the same stage again")):
        print(f"\nvLLM 0.22, then pdserve, on {machine} ({call}: twelve staging calls, `lease_2xh200.sh unpack`, then "
              "`lease_1gpu.sh s34b`), dummy Qwen3-8B bf16, vLLM's client, 1024/1024, 512 prompts at c256:\n")
        _sbs_table(f"{base}/{call}/sbs")
        print(f"\nThe steps such a run is made of, in the same call "
              f"({_ceilings(load(f'{base}/{call}/steps.json')['ceilings'])}):\n")
        _steps_bounds(f"{base}/{call}/steps.json")
    print("\nEach run against its serial bound (`run_bound.py`: every KV byte the run reads at the HBM copy rate, or its "
          "attention FLOPs at the matmul rate, whichever is more, plus its products' FLOPs at the matmul rate, or the "
          "fewest decode steps' weight reads; the ceilings of the bench_steps.py run in the same call):\n")
    print("| call | server (client) | duration s | out tok/s | serial bound s | of the bound |\n|---|---|---|---|---|---|")
    runs = [(call, name, f"sbs/{n}_single_1024x1024_c256.json") for call in ("s34b", "s34b_r2")
            for name, n in (("vLLM (vLLM's)", "vllm"), ("pdserve (vLLM's)", "pdserve"))]
    runs.append(("s34a", "pdserve (pdserve's)", "c256.json"))
    bounds = {}
    for call, name, rel in runs:
        st = load(f"{base}/{call}/steps.json")
        b = bounds.setdefault(call, rb.run_bound(st["engine"], st["ceilings"], 1024, 1024, 512, 256))
        res = load(f"{base}/{call}/{rel}")
        print(f"| {call} | {name} | {res['duration']:.2f} | {res['output_throughput']:,.1f} | {b['bound_s']:.2f} | "
              f"{rb.fraction(b, res):.1%} |")
    print()
    for call in ("s34b", "s34b_r2"):
        b = bounds[call]
        v = load(f"{base}/{call}/sbs/vllm_single_1024x1024_c256.json")
        print(f"- {call}'s bound: attention {b['attention_s']:.2f} s (KV read {b['kv_read_s']:.2f} s, its FLOPs "
              f"{b['attn_flops_s']:.2f} s) plus products {b['products_s']:.2f} s (FLOPs; the weights' read over the "
              f"{b['min_decode_steps']} fewest decode steps would take {b['weights_read_s']:.2f} s): "
              f"{b['bound_output_tps']:,.1f} out tok/s at most; 1.15x vLLM's output tok/s in that call would need a "
              f"run at {rb.needed(b, v, 1.15):.1%} of it")
    print(f"\nMixture-of-experts floors recorded before this session counted no expert FLOPs (bench_steps.floors now "
          f"counts each token's top_k experts, and a step's expert reads by its tokens' expected routing): session "
          f"11's 8k prefill of dummy Qwen3-30B-A3B (fp8 KV, from k/v), floor "
          f"{_moe_prefill_floor_recount('lease_s11/newkv_steps/qwen3-30b-a3b_prefill-new-kv.json', 'pdserve/model/configs/qwen3-30b-a3b.json')}.")


def _moe_prefill_floor_recount(rel: str, config: str) -> str:
    """A bench_steps record of dummy Qwen3-30B-A3B's 8k prefill from before session 34 (no expert FLOPs counted),
    recounted with each token multiplying its top_k experts (the shipped config's shapes)."""
    bs = _script("bench_steps", "engine/bench_steps.py")
    d = load(rel)
    cfg = json.loads((B.parent / config).read_text())
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    sizes = {**d["engine"], "expert_params": cfg["num_hidden_layers"] * e * 3 * h * i, "expert_bytes": 0,
             "num_experts": e, "top_k": cfg["num_experts_per_tok"]}
    r = {x["case"]: x for x in d["results"]}["prefill:8192"]
    f = bs.floors(sizes, d["ceilings"], [(0, 8192)], 1)
    return (f"{r['floor_ms']:.2f} ms recorded ({r['fraction_of_floor']:.1%} of its {r['step_ms_median']:.2f} ms), "
            f"{f['compute_floor_ms']:.2f} ms with each token's {cfg['num_experts_per_tok']} experts counted "
            f"({f['compute_floor_ms'] / r['step_ms_median']:.1%})")


def session33() -> None:
    """Session 33 (machine 1, an H200: the decode kernel's grid order; machine 2, an H200: a TMA GEMM against cuBLAS;
    machine 3, a 2xH200: 1P1D against vLLM's 1P1D twice, then the single-GPU side by side)."""
    base = "lease_s33"
    print("Reading a batch-256 decode step's KV (s33a, machine 1, `probe_kv_read.py --quick`: 256 rows x 1088 keys x 8 KV "
          "heads x 128, bf16, the engine's head-major pool; the paged read's best settings of session 22 and the decode "
          "kernel at the engine's tile, layers cycled), by the pool's blocks (12 layers a block: 0.75 MiB; 36, dummy "
          "Qwen3-8B's: 2.25 MiB), the block table (random pages, or each row's in order) and the grid's order (rows "
          "first, as the decode kernel; KV heads first: a row's heads, which share each block, side by side), us a layer "
          "(of the same run's HBM copy rate):\n")
    runs = [("12", "random"), ("36", "random"), ("36", "seq")]
    data = {r: load(f"{base}/s33a/kv_read_{r[0]}_{r[1]}.json") for r in runs}
    print("| probe | order | " + " | ".join(f"{n} layers, {pg} pages" for n, pg in runs) + " |\n|---|---|"
          + "---|" * len(runs))
    first = data[runs[0]]["rows"]
    for i, row in enumerate(first):
        label = (f"paged, {row['keys']} keys, {row['warps']} warps, {row['stages']} stages" if row["probe"] == "paged"
                 else f"decode, tile {tuple(row['tile'])}")
        print(f"| {label} | {row.get('order', 'row')} | " + " | ".join(
            f"{data[r]['rows'][i]['us']:.1f} ({data[r]['rows'][i]['of_copy']:.1%})" for r in runs) + " |")
    print("\n- HBM copy rates of the three runs: " + ", ".join(
        f"{data[r]['ceilings']['hbm_copy_gbps']:,.0f} GB/s" for r in runs))
    print(f"- the decode kernel heads first against rows first, bit for bit (test_heads_first_grid_cuda at 0efacc0): "
          f"`{_gpu_tests(f'{base}/s33a/gpu_tests.txt')}`")
    print("\nThe loops with the decode kernel's grid heads first (`bench_steps.py --decode-head-first`, decode.HEAD_FIRST "
          "at 0efacc0) and rows first (off, as shipped), one process an arm, in order, async at temperature 1, ms a step "
          "(of the floor):\n")
    _arm_ab(f"{base}/s33a", [("off", 1), ("hf", 2), ("off", 3), ("hf", 4)], ("hf",))
    print("- not shipped: HEAD_FIRST was taken out again (the decode kernel's grid stays rows first)")
    t = load(f"{base}/s33b/tma.json")
    print(f"\nA Triton GEMM with TMA loads against cuBLAS at 256 rows (s33b, machine 2, `bench_tma_linear.py`: "
          f"{sum(1 for r in t['results'] if r['impl'] == 'tma') // len(t['summary'])} configurations a shape, rows- or "
          f"weight-major tiles, one program a tile or persistent; CUDA graphs over weight copies larger than L2; same "
          f"run: {_ceilings(t['ceilings'])}), us a call (of the FLOPs' time at the matmul rate):\n")
    print("| projection | FLOPs us | weight read us | cuBLAS us | best TMA us | TMA / cuBLAS | best TMA tile (rows x "
          "outputs x K, warps, stages) | rows-major | weight-major | rows-major persistent | weight-major persistent "
          "|\n|---|---|---|---|---|---|---|---|---|---|---|")
    for x in t["summary"]:
        c, k = x["tma_config"], x["best_by_kind"]
        tile = (f"{c['block_r']}x{c['block_w']}x{c['block_k']}, {c['num_warps']}, {c['num_stages']}, "
                f"{'weight' if c['swap'] else 'rows'}-major{', persistent' if c['persistent'] else ''}")
        print(f"| {x['shape']} {x['n']}x{x['k']} | {x['flop_us']:.2f} | {x['byte_us']:.2f} | {x['cublas_us']:.2f} "
              f"({x['cublas_of_flops']:.0%}) | {x['tma_us']:.2f} ({x['tma_of_flops']:.0%}) | {x['tma_over_cublas']:.3f} | "
              f"{tile} | {k['rows']:.2f} | {k['swap']:.2f} | {k['rows+persistent']:.2f} | {k['swap+persistent']:.2f} |")
    cub = sum(x["cublas_us"] for x in t["summary"]) * 36
    best = sum(min(x["cublas_us"], x["tma_us"]) for x in t["summary"]) * 36
    print(f"\n- a step's four per-layer products at 36 layers: {cub / 1e3:.3f} ms on cuBLAS, {best / 1e3:.3f} ms taking "
          f"the faster of each ({(cub - best) / 1e3:.3f} ms less); the largest relative error of a best tile against "
          f"torch.mm: {max(x['tma_rel_err'] for x in t['summary']):.2g}")
    won = [x for x in t["summary"] if x["tma_us"] < x["cublas_us"]]
    lost = [x["shape"] for x in t["summary"] if x["tma_us"] >= x["cublas_us"]]
    print("- not shipped: " + ", ".join(f"{x['shape']} {x['cublas_us'] - x['tma_us']:.2f} us a call faster on TMA"
                                        for x in won)
          + f"; {' and '.join(lost)} slower. The engine's down runs split over K in two parts at 256 rows "
          "(pdserve/ops/configs/split_k, summed by the next add+RMSNorm), which this comparison of plain products "
          "left out")
    print("\n1P1D on 2xH200 at the session's tree (machine 3; `lease_2xh200.sh pd_one`, PD_MODE=pd-pdserve then "
          "pd-vllm, twice: pd_r1/ and pd_r2/): `pdserve serve --prefill 1 --decode 1` (cuda_ipc) against vLLM 0.22 with "
          "NixlConnector behind the anchors' proxy; dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench "
          "serve` on both. The staging carried NIXL's wheels this time, in twelve parts:\n")
    pairs = _pd_rounds(lambda r, n, w: f"{base}/pd_r{r}/pd-{n}/{n}_pd_{w}.json", criterion=True)
    for r in ("1", "2"):
        v, p = pairs[(r, "1024x1024_c256")]
        vs, ps = (load(f"{base}/pd_r{r}/pd-{m}/{m}_pd_server.json") for m in ("vllm", "pdserve"))
        comp = ", ".join(f"{n} {_compiles(f'{base}/pd_r{r}/pd-pdserve/pdlogs/{n}0.log.gz')}"
                         for n in ("prefill", "decode"))
        print(f"- round {r}: inter-token latency median / p99 vLLM {v['median_itl_ms']:.1f} / {v['p99_itl_ms']:.1f} ms, "
              f"pdserve {p['median_itl_ms']:.1f} / {p['p99_itl_ms']:.1f} ms; start-up (launch to first completion "
              f"through the proxy or router) vLLM {vs['startup_s']:.1f} s, pdserve {ps['startup_s']:.1f} s; KV tokens "
              f"vLLM {vs['kv_tokens']:,}, pdserve {ps['kv_tokens']:,}; kernels pdserve's instances compiled while "
              f"serving: {comp}")
    print(f"\nOne GPU each at once (sbs/, the same machine after the 1P1D rounds, `SBS_WORKLOADS=\"1024:1024:512:256\" "
          f"SBS_ROUNDS=1 SBS_CLIENTS=vllm lease_2xh200.sh sbs`; kernels pdserve compiled while serving: "
          f"{_compiles(f'{base}/sbs/pdserve.log.gz')}), vLLM's client:\n")
    _sbs_table(f"{base}/sbs")
    offs = [next(lp for lp in load(f"{base}/s33a/loop_{i}_off.json")["loops"] if lp["async"]
                 and lp["case"] == "loop:256x1024") for i in (1, 3)]
    d = load(f"{base}/s33a/loop_1_off.json")
    e, c = d["engine"], d["ceilings"]
    rate = c["hbm_copy_gbps"] * 1e6
    print("\nWhat the batch-256 criterion leaves (s33a's off arms; the floor is the step's bytes at the copy rate; a step "
          "whose products ran at the same run's matmul rate and whose kernels did not overlap could not beat the KV's "
          "read plus the larger of the weights' read and the products' FLOPs):\n")
    print("| run | rows at context | KV read ms | weights' read ms | products' FLOPs ms | floor ms | no-overlap bound ms "
          "(of floor) | measured ms (of floor) |\n|---|---|---|---|---|---|---|---|")
    for i, lp in zip((1, 3), offs):
        rows, ctx = lp["rows_per_step"], round(lp["mean_context"])
        kv = rows * (ctx + 1) * e["kv_bytes_per_token"] / rate
        w = e["weight_bytes_read"] / rate
        mm = 2 * rows * (e["linear_params"] + e["lm_head_params"]) / (c["bf16_matmul_tflops"] * 1e9)
        bound = kv + max(w, mm)
        print(f"| loop_{i}_off | {rows:.0f} at {ctx} | {kv:.2f} | {w:.2f} | {mm:.2f} | {lp['floor_ms']:.2f} | "
              f"{bound:.2f} ({lp['floor_ms'] / bound:.0%}) | {lp['step_ms']:.2f} ({lp['fraction_of_floor']:.0%}) |")
    lp = offs[0]
    kv1 = lp["rows_per_step"] * (round(lp["mean_context"]) + 1) * e["kv_bytes_per_token"] / rate
    w1 = e["weight_bytes_read"] / rate
    read = max(r["of_copy"] for d in data.values() for r in d["rows"] if r["probe"] == "paged")
    print(f"- overlapping the products of one half of the rows with the attention of the other (two micro-batches on "
          f"two streams) reads the weights twice: the KV read plus two weights' reads take {kv1 + 2 * w1:.2f} ms at the "
          f"copy rate (loop_1_off), {(kv1 + 2 * w1) / read:.2f} ms at the best read-only rate above ({read:.1%} of "
          f"it), against {lp['floor_ms'] / 0.8:.2f} ms for 80 % of the floor: "
          f"{lp['floor_ms'] / 0.8 - (kv1 + 2 * w1) / read:.2f} ms to spare only if every other kernel hid under that "
          f"traffic and the whole step streamed at the read-only ceiling")
    room = [lp["floor_ms"] / 0.8 - (rows * (round(lp["mean_context"]) + 1) * e["kv_bytes_per_token"] / rate
                                      + max(e["weight_bytes_read"] / rate, 2 * lp["rows_per_step"] * (
                                          e["linear_params"] + e["lm_head_params"]) / (c["bf16_matmul_tflops"] * 1e9)))
            for lp in offs]
    m = load("lease_s32/s32a/marginal256.json")
    r32 = next(r for r in m["loops"] if "profile" in r)
    p32, e32, c32 = r32["profile"], m["engine"], m["ceilings"]
    prods = sum(x["marginal_us_per_step"] for x in p32["top"] if x["name"].startswith("nvjet")) / 1e3
    flops32 = 2 * r32["rows_per_step"] * (e32["linear_params"] + e32["lm_head_params"]) / (
        c32["bf16_matmul_tflops"] * 1e9)
    small = sum(x["marginal_us_per_step"] for x in p32["top"]
                if x["name"] in ("_rms_norm_kernel", "_act_and_mul_kernel", "_qk_norm_rope_kernel")) / 1e3
    other = sum(x["marginal_us_per_step"] for x in p32["top"] if not x["name"].startswith("nvjet") and x["name"] not in (
        "_rms_norm_kernel", "_act_and_mul_kernel", "_qk_norm_rope_kernel", "_decode_kernel")) / 1e3
    print(f"\n- at 256 rows the products are compute-bound: their FLOPs take longer than their weights' read, which is "
          f"what the floor counts. With everything else free, a step would reach the bound's share of the floor. 80 % "
          f"of the floor leaves {min(room):.2f}-{max(room):.2f} ms beyond the bound for the products' shortfall from the "
          f"matmul rate, the norms, activation and rotary, the sampler and the gaps between kernels. Session 32's "
          f"profile (s32a, another machine) put them at {prods - flops32:.2f} ms (the products' marginal time less their "
          f"FLOPs' time at that run's matmul rate), {small:.2f} ms, {other:.2f} ms (the sampler's kernels, copies and "
          f"index kernels) and {r32['gpu']['idle_us_per_step'] / 1e3:.2f} ms of idle GPU a step")


def session32() -> None:
    """Session 32 (machine 1, an H200, two calls; machines 2 and 3, an H200 each, one call; machine 4, a 2xH200;
    machine 5, an H200, one call):
    the rotary in the decode kernel's many-program launch; where the batch-256 step's time goes; what the KV sizing
    probe's peak was made of; the second probe that measures the library attention's transients in place of their
    bound; the side by side at 1024/1024 c256, twice."""
    base = "lease_s32"
    print("The layer's QK-norm, rotary and new K/V write in the decode kernel's many-program launch too (s32a, machine "
          "1, call 1; decode.ROPE_MANY_PROGRAMS, off as shipped: a batch-256 step runs the rotary kernel before its "
          "decode launch). The loops of dummy Qwen3-8B, one process an arm, in order, async at temperature 1, ms a "
          "step (of the floor). off: as shipped; many: `bench_steps.py --decode-rope-many` (held to "
          "decode.ROPE_MAXNREG registers); many0: many without that limit (`--decode-rope-maxnreg 0`), which lifts "
          "it from the batch-1 launch too:\n")
    _arm_ab(f"{base}/s32a", [("off", 1), ("many", 2), ("many0", 3), ("off", 4), ("many", 5), ("many0", 6)],
            ("many", "many0"))
    print("- not shipped: decode.ROPE_MANY_PROGRAMS stays False (a batch-256 step keeps the rotary kernel)")
    m = load(f"{base}/s32a/marginal256.json")
    r = next(r for r in m["loops"] if "profile" in r)
    p, g, e, c = r["profile"], r["gpu"], m["engine"], m["ceilings"]
    print(f"\nWhere the batch-256 step's time goes as shipped (s32a, the same call, `bench_steps.py --profile-loop "
          f"256x1024 --loop-steps {p['steps']}`: the async loop at temperature 1 under the torch profiler; marginal "
          f"time as in session 31's s31c: how far a kernel's end pushes the latest end of the kernels before it). Per "
          f"kernel, a step (nvjet: cuBLAS's products, four a layer and the LM head):\n")
    print("| kernel | launches | us | share | marginal us | marginal us a launch |\n|---|---|---|---|---|---|")
    named = [t for t in p["top"] if t["name"].startswith(("_", "nvjet"))]
    rest = [t for t in p["top"] if t not in named]
    for t in named:
        print(f"| {t['name']} | {t['count_per_step']:.0f} | {t['us_per_step']:.0f} | {t['share']:.1%} | "
              f"{t['marginal_us_per_step']:.0f} | {t['marginal_us_per_step'] / t['count_per_step']:.2f} |")
    print(f"| other (copies, torch's index kernels) | {sum(t['count_per_step'] for t in rest):.0f} | "
          f"{sum(t['us_per_step'] for t in rest):.0f} | {sum(t['share'] for t in rest):.1%} | "
          f"{sum(t['marginal_us_per_step'] for t in rest):.0f} | |")
    mg = sum(t["marginal_us_per_step"] for t in p["top"]) / 1e3
    print(f"- {r['case']} ({r['rows_per_step']:.0f} rows at {r['mean_context']:.0f} tokens of context): "
          f"{r['step_ms']:.2f} ms a step under the profiler; {p['kernels_per_step']:.0f} kernels, "
          f"{p['gpu_us_per_step'] / 1e3:.2f} ms of kernel spans, {mg:.2f} ms of marginal time; GPU busy "
          f"{g['busy_us_per_step'] / 1e3:.2f} ms and idle {g['idle_us_per_step'] / 1e3:.2f} ms a step")
    rows, ctx, rate = r["rows_per_step"], round(r["mean_context"]), c["hbm_copy_gbps"] * 1e6
    kv_ms = rows * (ctx + 1) * e["kv_bytes_per_token"] / rate
    w_ms = e["weight_bytes_read"] / rate
    mm_ms = 2 * rows * (e["linear_params"] + e["lm_head_params"]) / (c["bf16_matmul_tflops"] * 1e9)
    dec = sum(t["marginal_us_per_step"] for t in p["top"] if t["name"] == "_decode_kernel") / 1e3
    mm = sum(t["marginal_us_per_step"] for t in p["top"] if t["name"].startswith("nvjet")) / 1e3
    print(f"- the floor's two parts at the same run's copy rate ({c['hbm_copy_gbps']:,.0f} GB/s): the KV read "
          f"{kv_ms:.2f} ms, against _decode_kernel's {dec:.2f} ms of marginal time ({kv_ms / dec:.0%}); the weights' "
          f"read {w_ms:.2f} ms, against the products' {mm:.2f} ms ({w_ms / mm:.0%}). The products' FLOPs at "
          f"{rows:.0f} rows take {mm_ms:.2f} ms at the same run's bf16 matmul rate ({c['bf16_matmul_tflops']:.0f} "
          f"TFLOP/s; {mm_ms / mm:.0%} of their marginal time); the step's floor is its bytes' time, its FLOPs' being "
          f"less as a whole")

    def mib_sites(peak: dict) -> str:
        """The live blocks at a replayed peak by site, the probe pool (runner.py's) left out, MiB."""
        return ", ".join(f"{s['site'].split('pdserve/')[-1]} {s['bytes'] / 2**20:.0f}" for s in peak["at_peak"]
                         if "engine/runner.py" not in s["site"])

    def pool_bytes(peak: dict) -> int:
        return sum(s["bytes"] for s in peak["at_peak"] if "engine/runner.py" in s["site"])
    pb, pc = load(f"{base}/s32b/probe.json"), load(f"{base}/s32c1/probe.json")
    log = {f: _srv_line(f"{base}/{f}/server.log.gz", "largest step") for f in ("s32c1", "s32c2")}
    fresh = {f: float(re.search(r"peaked at ([0-9.]+) GiB", ln).group(1)) for f, ln in log.items()}
    model_b = sum(x["bytes"] for x in pb["before_probe"]["by_site"] if "pdserve/model/" in x["site"])
    attn_b = sum("pdserve/ops/attention/" in x["site"] for x in pb["probe_peak"]["at_peak"]) or "none"
    bb = e["block_bytes"]
    bt = bb // e["kv_bytes_per_token"]
    print(f"\nThe KV sizing probe (`probe_memory.py`: the engine built as `pdserve serve` builds dummy Qwen3-8B at "
          f"--max-model-len 40960 and --gpu-memory-utilization 0.9, the allocator's history replayed). Before it, "
          f"{pb['before_probe']['memory_allocated'] / 2**30:.3f} GiB allocated, {model_b / 2**30:.3f} of it at "
          f"pdserve/model/ sites (the weights). s32b (machine 1, call 2, as sized until then): the engine's measured peak "
          f"{pb['measured_peak_bytes'] / 2**30:.3f} GiB, the probe step's own peak plus library_reserve's bound of "
          f"the library (cuDNN) attention's transients, added whole; replayed, the step's live blocks at its "
          f"allocated peak came to {(pb['probe_peak']['allocated_peak_bytes'] - pool_bytes(pb['probe_peak'])) / 2**30:.3f} "
          f"GiB beside the probe pool (MiB: {mib_sites(pb['probe_peak'])}), {attn_b} of them in pdserve/ops/attention/. s32c1 (machine "
          f"2, the second probe: a prompt of 40959 tokens alone, its last chunk a whole 8192-token budget on the "
          f"longest prefix, measured in place of the bound); s32c2 (machine 3, the same with an empty_cache at the end "
          f"of engine start, Worker.release_cached). Peaks, GiB above the weights; pool at 0.9 (blocks of {bt} tokens, "
          f"{bb / 2**20:.2f} MiB each):\n")
    print("| run | fresh rows' step | long prompt's last chunk | bound added | sizing peak | pool blocks | pool GiB | "
          "KV tokens |\n|---|---|---|---|---|---|---|---|")
    print(f"| s32b | not recorded apart | not run | added whole | {pb['measured_peak_bytes'] / 2**30:.3f} | {pb['num_blocks']:,} | "
          f"{pb['num_blocks'] * bb / 2**30:.2f} | {pb['num_blocks'] * bt:,} |")
    for f in ("s32c1", "s32c2"):
        d = load(f"{base}/{f}/probe.json")
        s = d["step_peak"]
        print(f"| {f} | {fresh[f]:.2f} (the server's log) | {s['long_peak_bytes'] / 2**30:.3f} (prefix "
              f"{s['long_prefix']}) | {s['bound_bytes'] / 2**30:.3f} | {s['peak_bytes'] / 2**30:.3f} | "
              f"{d['num_blocks']:,} | {d['num_blocks'] * bb / 2**30:.2f} | {d['num_blocks'] * bt:,} |")
    print(f"\n- s32b's measured {pb['measured_peak_bytes'] / 2**30:.3f} GiB less s32c1's fresh-rows step "
          f"({fresh['s32c1']:.2f} GiB, the same step): {pb['measured_peak_bytes'] / 2**30 - fresh['s32c1']:.2f} GiB, "
          f"the bound s32c no longer adds")
    print(f"- s32c1's replayed peak (the long prompt's chunk): "
          f"{(pc['probe_peak']['allocated_peak_bytes'] - pool_bytes(pc['probe_peak'])) / 2**30:.3f} GiB beside its "
          f"pool (MiB: {mib_sites(pc['probe_peak'])})")
    smi = {}
    for f in ("s32c1", "s32c2"):
        startup = (B / base / f / "startup.txt").read_text().strip()
        used, total = (int(x) for x in re.findall(r"(\d+) MiB", (B / base / f / "mem.txt").read_text()))
        smi[f] = used
        print(f"- {f}, `pdserve serve` at 0.9: {startup}; nvidia-smi then: {used:,} of {total:,} MiB in use"
              + (f" ({used - smi['s32c1']:+,} MiB against s32c1; this tree ends engine start with empty_cache)"
                 if f == "s32c2" else ""))
    print("\nThe KV sizing and warm-up GPU tests with the second probe and no margin (s32c1 at 2f2601a, s32c2 at "
          "6b8940a; tests/engine/test_memory_profile.py and test_warmup.py, `-m gpu`):\n")
    for f in ("s32c1", "s32c2"):
        txt = (B / base / f / "gpu_tests.txt").read_text()
        err = next(ln for ln in txt.splitlines() if "AssertionError" in ln).split("AssertionError: ", 1)[1]
        used, allowed = (int(x) for x in re.search(r"and (\d+) <= (\d+)\)", txt).groups())
        failed = next(ln for ln in txt.splitlines() if ln.startswith("FAILED")).split("::")[-1]
        print(f"- {f}: `{_gpu_tests(f'{base}/{f}/gpu_tests.txt')}`; {failed}: {err} (over the share by "
              f"{(used - allowed) / 2**20:.1f} MiB)")
    print(f"- mem_tests (machine 4, GPU 0, at 872ff57, POOL_MARGIN_BYTES = 32 MiB; test_memory_profile.py's GPU tests, "
          f"the largest steps beside pools sized at 0.3 and 0.6): `{_gpu_tests(f'{base}/mem_tests/gpu_tests.txt')}`")
    print("- shipped: the second probe (2f2601a) and POOL_MARGIN_BYTES = 32 MiB (872ff57). The empty_cache at the end of "
          "engine start (Worker.release_cached, 6b8940a) changed nothing the test read (it runs no warm-up) and was "
          "reverted (f99a48a), then re-landed (3f26370) for what nvidia-smi read after a server's start and first "
          "completion (above: two machines); the side by side below ran at 872ff57, without it")
    f1, f2 = f"{base}/sbs_c256_1", f"{base}/sbs_c256_2"
    print(f"\nThe side by side at 872ff57 (machine 4, a 2xH200: vLLM 0.22 on GPU 0 and pdserve on GPU 1 at once, dummy "
          f"Qwen3-8B bf16, vLLM's `bench serve` client for both; the \"commit\" in comparison.json, "
          f"{load(f'{f1}/comparison.json')['commit'][:7]}, is the device copy's stale HEAD). sbs_c256_1/: "
          f"`SBS_WORKLOADS=\"1024:1024:512:256\" SBS_ROUNDS=1 SBS_CLIENTS=vllm lease_2xh200.sh sbs`, both servers' "
          f"first start on the machine (kernels pdserve compiled while serving: {_compiles(f'{f1}/pdserve.log.gz')}):"
          f"\n")
    _sbs_table(f1)
    print(f"\nsbs_c256_2/: the same, after mem_tests, with the compile caches the first call had filled (kernels "
          f"pdserve compiled while serving: {_compiles(f'{f2}/pdserve.log.gz')}):\n")
    _sbs_table(f2)
    print()
    for f in (f1, f2):
        v = [_srv_line(f"{f}/vllm.log.gz", k) for k in ("torch.compile took", "Available KV cache memory")]
        pool = re.search(r"the pool gets ([0-9.]+ GiB)", _srv_line(f"{f}/pdserve.log.gz", "the pool gets")).group(1)
        ready = re.search(r"(\d+) KV blocks", _srv_line(f"{f}/pdserve.log.gz", "engine ready")).group(1)
        vs = [re.search(r"(torch.compile took [0-9.]+ s|Available KV cache memory: [0-9.]+ GiB)", ln).group(1)
              for ln in v]
        print(f"- {f.split('/')[-1]}: vLLM's log: {vs[0]}, {vs[1]}; pdserve's: the pool gets {pool}, {ready} blocks")
    comp = {f: load(f"{f}/comparison.json")["workloads"][0] for f in (f1, f2)}
    srv = {f: {n: load(f"{f}/{n}_single_server.json") for n in ("vllm", "pdserve")} for f in (f1, f2)}

    def check(x: float, bound: float, below: bool = True, digits: int = 3) -> str:
        met = x <= bound if below else x >= bound
        return f"{x:.{digits}f} ({'<=' if below else '>='} {bound}: {'met' if met else 'not met'})"

    def ratios(key: str, below: bool = True, bound: float = 1) -> str:
        return "; ".join(f"{f.split('/')[-1]}/ {check(w['pdserve'][key] / w['vllm'][key], bound, below)}"
                         for f, w in comp.items())
    print("\nAgainst issue 10's criteria, pdserve / vLLM as vLLM's client measured them:\n")
    print("- KV tokens at --gpu-memory-utilization 0.9: " + "; ".join(
        f"{f.split('/')[-1]}/ {x['pdserve']['kv_tokens']:,} / {x['vllm']['kv_tokens']:,} = "
        f"{check(x['pdserve']['kv_tokens'] / x['vllm']['kv_tokens'], 1, False, 4)}" for f, x in srv.items()))
    out = [w["pdserve"]["output_throughput"] / w["vllm"]["output_throughput"] for w in comp.values()]
    print(f"- 1024/1024 c256 output tok/s: {ratios('output_throughput', False, 1.0)}; aim 1.15: "
          f"{'met' if min(out) >= 1.15 else 'not met'}")
    print(f"- mean TPOT: {ratios('mean_tpot_ms')}")
    print(f"- mean TTFT: {ratios('mean_ttft_ms')}")
    print("- start-up (launch to first completion): " + "; ".join(
        f"{f.split('/')[-1]}/ {x['pdserve']['startup_s']:.1f} / {x['vllm']['startup_s']:.1f} s = "
        f"{check(x['pdserve']['startup_s'] / x['vllm']['startup_s'], 1)}" for f, x in srv.items()))
    offs = [next(lp for lp in load(f"{base}/s32a/loop_{i}_off.json")["loops"] if lp["async"]
                 and lp["case"] == "loop:256x1024") for i in (1, 4)]
    print("- steady decode at batch 256, of its floor (s32a's off arms): " + "; ".join(
        f"{lp['step_ms']:.2f} ms, {check(lp['fraction_of_floor'], 0.8, False)}" for lp in offs))
    d = load(f"{base}/s32d/steps.json")
    print(f"\nThe engine microbenchmark at 85a6c75 (the engine code of 872ff57; s32d, machine 5, an H200, "
          f"`lease_1gpu.sh s32d`: bench_steps.py's default cases, dummy Qwen3-8B, --iters {d['args']['iters']}, loops "
          f"of {d['args']['loop_steps']} steps at temperature {d['args']['loop_temperature']}; same run: "
          f"{_ceilings(d['ceilings'])}):\n")
    _run_table(d)
    pf = next(r for r in d["results"] if r["case"] == "prefill:8192")
    b256 = next(lp for lp in d["loops"] if lp["async"] and lp["case"] == "loop:256x1024")
    print(f"\n- prefill of 8k tokens, of the matmul ceiling: {check(pf['fraction_of_floor'], 0.75, False)}")
    print(f"- steady decode at batch 256, of its floor: {check(b256['fraction_of_floor'], 0.8, False)}")


def session31() -> None:
    """Session 31 (machine 1, an H200, three calls; machine 2, another H200; machine 4, a 2xH200, after machine 3
    failed its staging): where the shipped batch-1 step's time goes under PDL (each kernel's marginal time); the
    folded one-row products alone with PDL off; the decode kernel merging its own splits; the batch-1 step in serving
    against the engine loop; the decode kernel taking the layer's QK-norm, rotary and K/V write; the side by side with
    vLLM at the shipped code."""
    base = "lease_s31"
    prof_loops = [r for r in load(f"{base}/s31c/marginal.json")["loops"] if "profile" in r]
    print("Where the batch-1 step's time goes with PDL as shipped (s31c, call 1, `bench_steps.py --profile-loop "
          "1x8192,1x32768`: the async loop of dummy Qwen3-8B at temperature 1, 40 steps under the torch profiler). A "
          "kernel's own span holds its wait for the kernel before it; its marginal time is how far its end pushes the "
          "latest end of the kernels that started before it (what it adds to the step; the marginal times sum to the "
          "GPU's busy time). Per kind, a step:\n")
    ctx = [f"{r['mean_context'] / 1024:.0f}k" for r in prof_loops]
    print("| kernel | launches | " + " | ".join(f"{c} us | {c} marginal us" for c in ctx) + " |\n|---|---|"
          + "---|---|" * len(prof_loops))
    tops = [{t["name"]: t for t in r["profile"]["top"]} for r in prof_loops]
    named = [n for n in tops[0] if n.startswith("_")]
    for n in named:
        counts = dict.fromkeys(f"{t[n]['count_per_step']:.0f}" for t in tops)
        print(f"| {n} | {' / '.join(counts)} | " + " | ".join(
            f"{t[n]['us_per_step']:.0f} | {t[n]['marginal_us_per_step']:.0f}" for t in tops) + " |")
    rest = [[t[n] for n in t if n not in named] for t in tops]
    counts = dict.fromkeys(f"{sum(x['count_per_step'] for x in r):.0f}" for r in rest)
    print(f"| other (copies, torch's index kernels) | {' / '.join(counts)} | " + " | ".join(
        f"{sum(x['us_per_step'] for x in r):.0f} | {sum(x['marginal_us_per_step'] for x in r):.0f}" for r in rest)
        + " |")
    for r in prof_loops:
        p, g = r["profile"], r["gpu"]
        mg = sum(t["marginal_us_per_step"] for t in p["top"])
        print(f"- {r['case']} ({r['mean_context']:.0f} tokens of context): {r['step_ms']:.2f} ms a step under the "
              f"profiler; {p['kernels_per_step']:.0f} kernels, {p['gpu_us_per_step'] / 1e3:.2f} ms of kernel spans, "
              f"{mg / 1e3:.2f} ms of marginal time; GPU busy {g['busy_us_per_step'] / 1e3:.2f} ms and idle "
              f"{g['idle_us_per_step'] / 1e3:.2f} ms a step")
    folds = {f: {r["shape"]: r for r in load(f"{base}/s31b/folds_{f}.json")["results"]} for f in ("early", "off")}
    kinds = [("q/k/v (norm's scale in)", "qkv"), ("o (residual add, norm's parts out)", "o"),
             ("gate_up (norm's scale in)", "gate_up"), ("down (activation in, norm's parts out)", "down"),
             ("LM head", None)]

    def by_kind(prof: dict, name: str, key: str) -> list[float]:
        """Mean us a launch of `name` at each position in the layer (the one-row products: the kinds, then the LM
        head), or over all its launches."""
        sl = next(t[key] for t in prof["top"] if t["name"] == name)
        if name != "_skinny_sum_kernel":
            return [sum(sl) / len(sl)]
        whole = 4 * prof["layers"]
        return [sum(sl[i:whole:4]) / len(sl[i:whole:4]) for i in range(4)] + [sum(sl[whole:]) / len(sl[whole:])]
    print("\nThe same loops by the kernel's position in the layer, us a launch (own span / marginal), against the "
          "folded product alone in a CUDA graph with PDL as shipped (s31b):\n")
    print("| kernel | " + " | ".join(f"{c} own | {c} marginal" for c in ctx)
          + " | alone (s31b), PDL early |\n|---|" + "---|---|" * len(prof_loops) + "---|")
    cols = [(by_kind(r["profile"], "_skinny_sum_kernel", "slots_us"),
             by_kind(r["profile"], "_skinny_sum_kernel", "marginal_slots_us")) for r in prof_loops]
    for i, (kind, shape) in enumerate(kinds):
        alone = f" {folds['early'][shape]['us']:.2f} |" if shape else " |"
        print(f"| {kind} | " + " | ".join(f"{own[i]:.2f} | {mg[i]:.2f}" for own, mg in cols) + f" |{alone}")
    for name in ("_decode_kernel", "_merge_kernel", "_qk_norm_rope_kernel"):
        print(f"| {name} | " + " | ".join(f"{by_kind(r['profile'], name, 'slots_us')[0]:.2f} | "
                                          f"{by_kind(r['profile'], name, 'marginal_slots_us')[0]:.2f}"
                                          for r in prof_loops) + " | |")
    s29b = [r for r in load("lease_s29/s29b/slots_pdl_off.json")["loops"] if "profile" in r][0]
    off_loop = by_kind(s29b["profile"], "_skinny_sum_kernel", "slots_us")
    ceil = {f: load(f"{base}/s31b/folds_{f}.json")["ceilings"]["hbm_copy_gbps"] for f in ("early", "off")}
    print(f"\nThe folded one-row products alone (s31b, call 1, `bench_linear.py --folds --shipped-only --pdl "
          f"early|off`: the tile serving takes, in a CUDA graph over weight copies larger than L2; HBM copy "
          f"{ceil['early']:,.0f} / {ceil['off']:,.0f} GB/s in the two runs). With PDL off each launch waits for the "
          f"whole of the one before, so the graph times each kernel's own span. Against the same kernel in the "
          f"batch-1 8k loop: its own span with PDL off (s29b: session 29, another H200, before the fold entries, so "
          f"the folded kernels ran the plain products' tiles) and its marginal time with PDL as shipped (s31c), us a "
          f"launch (of the copy rate):\n")
    print("| projection | fold | tile | alone, PDL early | alone, PDL off | loop, PDL off (s29b) | loop, marginal "
          "(s31c) |\n|---|---|---|---|---|---|---|")
    mg8 = cols[0][1]
    for i, (_, shape) in enumerate(kinds[:4]):
        e, o = folds["early"][shape], folds["off"][shape]
        c = e["config"]
        print(f"| {shape} | {e['fold']} | {c['block_n']}x{c['block_k']}, {c['num_warps']}w {c['num_stages']}s"
              f"{', prefetch' if c['prefetch'] else ''} | {e['us']:.2f} ({e['of_copy']:.0%}) | {o['us']:.2f} "
              f"({o['of_copy']:.0%}) | {off_loop[i]:.2f} | {mg8[i]:.2f} |")
    plain = load(f"{base}/s31b/plain_off.json")
    s29a = load("lease_s29/s29a/linear.json")

    def cell(d: dict, shape: str, impl: str, cfg: tuple | None) -> str:
        def key(c):
            return (c["block_n"], c["block_k"], c["num_warps"], c["num_stages"], c["kind"])
        r = next((r for r in d["results"] if r["shape"] == shape and r["rows"] == 1 and "us" in r
                  and r["impl"].startswith(impl) and (cfg is None or key(r["config"]) == cfg)), None)
        return f"{r['us']:.2f}" if r else "-"
    tiles = [("cublas", "cuBLAS", None), ("cublas_mv", "torch.mv", None),
             ("skinny", "sum 8x1024, 4w 3s", (8, 1024, 4, 3, "sum")),
             ("skinny", "dot 16x256, 4w 4s", (16, 256, 4, 4, "dot"))]
    print(f"\nThe plain one-row products alone with PDL off (s31b, `bench_linear.py --rows 1 --pdl off`: cuBLAS, "
          f"torch.mv and the skinny kernel's two default tiles; HBM copy {plain['ceilings']['hbm_copy_gbps']:,.0f} "
          f"GB/s), against session 29's s29a (`bench_linear.py --rows 1 --sweep`, PDL as shipped, another H200), us, "
          f"PDL off (s31b) / early (s29a):\n")
    print("| projection | " + " | ".join(t[1] for t in tiles) + " |\n|---|" + "---|" * len(tiles))
    for shape in dict.fromkeys(r["shape"] for r in plain["results"]):
        print(f"| {shape} | " + " | ".join(f"{cell(plain, shape, i, c)} / {cell(s29a, shape, i, c)}"
                                          for i, _, c in tiles) + " |")
    print("\nThe decode kernel merging its own splits (s31d, call 2; decode.SELF_MERGE, off as shipped: the last of a "
          "row's and KV head's splits to finish merges them, no merge kernel): its GPU tests with it on (`"
          + _gpu_tests(f"{base}/s31d/gpu_tests.txt") + "`), then the batch-1 loops, one process an arm, in order, at "
          "temperature 1, ms a step (of the floor):\n")
    arms = [("off", 1), ("on", 2), ("off", 3), ("on", 4)]
    _loop_arms(f"{base}/s31d", arms)
    means = _arm_means(f"{base}/s31d", arms)
    print("\n- on - off, the mean of each arm's two: " + ", ".join(
        f"{case} {m['on'] - m['off']:+.3f} ms" for case, m in means.items()))
    loops = {w: next(r for r in load(f"{base}/s31a/loop_{w}.json")["loops"] if r["async"])
             for w in ("before", "after")}
    print(f"\nThe batch-1 step in serving against the engine loop on the same GPU (s31a, call 3): the async loop at 8k "
          f"(`bench_steps.py --loop 1x8192 --loop-steps 200 --max-model-len 40960`, temperature 1), then `pdserve "
          f"serve` of dummy Qwen3-8B as the side by side starts it (kernels it compiled while serving: "
          f"{_compiles(f'{base}/s31a/server.log.gz')}), driven by `pdserve bench serve` one request at a time "
          f"(--max-concurrency 1, --ignore-eos, a warm-up request, seed 0), then the loop again. The 256-token run "
          f"follows the 16-token run of the same length and seed, so its prompts are prefix-cache hits (its TTFT is "
          f"not a prefill):\n")
    for w, r in loops.items():
        print(f"- loop {w}: {r['case']} {r['step_ms']:.2f} ms a step (floor {r['floor_ms']:.2f} ms, "
              f"{r['fraction_of_floor']:.0%}) at {r['mean_context']:.0f} tokens of context, {r['steps']} steps")
    step = sum(r["step_ms"] for r in loops.values()) / len(loops)
    print("\n| run | ok | out tok/s | mean / median / p90 TTFT ms | mean / p90 TPOT ms | median ITL ms | mean E2EL "
          "ms | mean TPOT - loop's step ms |\n|---|---|---|---|---|---|---|---|")
    for run in ("8192x16x16", "8192x256x4"):
        d = load(f"{base}/s31a/serve_{run}.json")
        i, o, n = run.split("x")
        print(f"| {i} in / {o} out x{n} | {d['completed']}/{d['completed'] + d['failed']} | "
              f"{d['output_throughput']:.1f} | {d['mean_ttft_ms']:.1f} / {d['median_ttft_ms']:.1f} / "
              f"{d['p90_ttft_ms']:.1f} | "
              f"{d['mean_tpot_ms']:.2f} / {d['p90_tpot_ms']:.2f} | {d['median_itl_ms']:.2f} | "
              f"{d['mean_e2el_ms']:.1f} | {d['mean_tpot_ms'] - step:+.2f} |")
    print("\nThe decode kernel taking the layer's QK-norm, rotary and new K/V write (s31e, machine 2, another H200, one "
          "call; decode.ROPE_IN_DECODE, off in the tree that ran and on as shipped since: decode-only steps leave the "
          "rotary kernel out, one launch a layer less): the decode kernel's rope GPU tests (`"
          + _gpu_tests(f"{base}/s31e/gpu_tests_kernel.txt") + "`), the engine's GPU tests with it on (against "
          "transformers, the CUDA graphs' PDL changes no bit, a burst after the warm-up compiles nothing, async: `"
          + _gpu_tests(f"{base}/s31e/gpu_tests_engine.txt") + "`), then the loops, one process an arm, in order, at "
          "temperature 1, ms a step (of the floor). on: `bench_steps.py --decode-rope` (the newest key's one-row tile "
          "held to 128 registers, decode.ROPE_MAXNREG); on0: on without that limit (`--decode-rope-maxnreg 0`):\n")
    _arm_ab(f"{base}/s31e", [("off", 1), ("on", 2), ("on0", 3), ("off", 4), ("on", 5), ("on0", 6)], ("on", "on0"))
    sbs, c256 = f"{base}/sbs", f"{base}/sbs_c256"
    print(f"\nThe side by side with vLLM at the shipped code (machine 4, a 2xH200: vLLM 0.22 on GPU 0 and pdserve on "
          f"GPU 1 at once, dummy Qwen3-8B bf16, vLLM's `bench serve` client for both; tree b5e9d24 with "
          f"decode.ROPE_IN_DECODE on, the engine code of 40b7787; the \"commit\" in comparison.json, "
          f"{load(f'{sbs}/comparison.json')['commit'][:7]}, is the device copy's stale HEAD, not the tree that ran). "
          f"sbs/: `SBS_WORKLOADS=\"8192:16:16:1 32768:16:4:1\" SBS_ROUNDS=1 SBS_CLIENTS=vllm lease_2xh200.sh sbs`, one "
          f"request at a time; the first request of each run re-sends the warm-up prompt, a prefix-cache hit on both "
          f"servers. Kernels pdserve compiled while serving: {_compiles(f'{sbs}/pdserve.log.gz')}:\n")
    _sbs_table(sbs)
    print(f"\nsbs_c256/: the next call on the same machine, `SBS_WORKLOADS=\"1024:1024:512:256\"`, the same otherwise "
          f"(kernels pdserve compiled while serving: {_compiles(f'{c256}/pdserve.log.gz')}). Both servers started "
          f"again, with the compile caches the first call had filled, so this call's start-up is not a cold one:\n")
    _sbs_table(c256)
    comp = {w["workload"]: w for f in (sbs, c256) for w in load(f"{f}/comparison.json")["workloads"]}
    burst = _compare_module().BURST_S * 1e3
    print(f"\nHow the tokens arrived (compare.py's \"stream\" fields, from the one-at-a-time runs' per-request records; "
          f"the c256 runs kept none). vLLM's server sends several tokens in its first chunk: its TTFT waits for them, "
          f"and its client TPOT, (E2EL - TTFT) / (tokens - 1), is below its gap between tokens. First-chunk tokens are "
          f"an upper bound (exact when every later chunk carries one token); the steady gap is the median gap between "
          f"chunks longer than {burst:.1f} ms; the steady TPOT is (E2EL - TTFT) over those gaps:\n")
    print("| workload | chunks a request vLLM / pdserve | first-chunk tokens vLLM / pdserve | steady gap vLLM / pdserve "
          "ms | ratio | steady TPOT vLLM / pdserve ms | ratio |\n|---|---|---|---|---|---|---|")
    for name in sorted(w for w in comp if comp[w]["vllm"].get("stream")):
        v, p = comp[name]["vllm"]["stream"], comp[name]["pdserve"]["stream"]
        print(f"| {name} | {v['chunks_per_request']:.2f} / {p['chunks_per_request']:.2f} | "
              f"{v['first_chunk_tokens']:.2f} / {p['first_chunk_tokens']:.2f} | {v['steady_gap_ms']:.2f} / "
              f"{p['steady_gap_ms']:.2f} | {p['steady_gap_ms'] / v['steady_gap_ms']:.3f} | "
              f"{v['tpot_steady_ms']:.2f} / {p['tpot_steady_ms']:.2f} | "
              f"{p['tpot_steady_ms'] / v['tpot_steady_ms']:.3f} |")

    def ratio(name: str, key: str) -> float:
        return comp[name]["pdserve"][key] / comp[name]["vllm"][key]

    def check(x: float, bound: float, below: bool = True, digits: int = 3) -> str:
        met = x <= bound if below else x >= bound
        return f"{x:.{digits}f} ({'<=' if below else '>='} {bound}: {'met' if met else 'not met'})"
    print("\nAgainst issue 10's criteria, pdserve / vLLM as vLLM's client measured them:\n")
    for name, n in (("8192x16_c1", "8192/16"), ("32768x16_c1", "32768/16")):
        v, p = (_misses(load(f"{sbs}/{s}_single_{name}.json")) for s in ("vllm", "pdserve"))
        st = comp[name]["vllm"]["stream"]
        print(f"- {n} one at a time: mean TTFT {check(ratio(name, 'mean_ttft_ms'), 1)}; mean TPOT "
              f"{check(ratio(name, 'mean_tpot_ms'), 1.1)}; vLLM's {comp[name]['vllm']['mean_tpot_ms']:.2f} ms client "
              f"TPOT came from {st['chunks_per_request']:.2f} chunks a request. The requests after the first, vLLM / "
              f"pdserve: mean TTFT {v[0]:.1f} / {p[0]:.1f} ms ({p[0] / v[0]:.3f}), mean E2EL {v[1]:.1f} / {p[1]:.1f} "
              f"ms ({p[1] / v[1]:.3f})")
    name = "1024x1024_c256"
    print(f"- 1024/1024 c256: output tok/s {check(ratio(name, 'output_throughput'), 1.0, below=False)}, aim 1.15: "
          f"{'met' if ratio(name, 'output_throughput') >= 1.15 else 'not met'}; mean TPOT "
          f"{check(ratio(name, 'mean_tpot_ms'), 1)}; mean TTFT {check(ratio(name, 'mean_ttft_ms'), 1)}")
    srv = {f: {n: load(f"{f}/{n}_single_server.json") for n in ("vllm", "pdserve")} for f in (sbs, c256)}
    print("- KV tokens: " + "; ".join(
        f"{f.split('/')[-1]}/ {check(x['pdserve']['kv_tokens'] / x['vllm']['kv_tokens'], 1, False, 4)}"
        for f, x in srv.items()))
    print("- start-up (launch to first completion): " + "; ".join(
        f"{f.split('/')[-1]}/ {check(x['pdserve']['startup_s'] / x['vllm']['startup_s'], 1)}" for f, x in srv.items())
        + " (sbs_c256/ after the first call had filled both servers' compile caches)")


def session30() -> None:
    """Session 30 (four H200 machines, one after the other): the folded one-row products' tiles with a weight-tile
    prefetch; the decode kernel at one row (tiles, splits, block-table prefetch); the decode kernel's first tile read
    before its PDL wait, in the batch-1 loops at 1k, 8k and 32k."""
    base = "lease_s30"
    fo = load(f"{base}/s30a/folds.json")

    def tile(c):
        return (f"{c['block_n']}x{c['block_k']}, {c['num_warps']}w {c['num_stages']}s"
                + (", prefetch" if c.get("prefetch") else ""))
    print(f"The folded one-row products' tiles, each also prefetching its next weight tile (s30a, machine 1, "
          f"`bench_linear.py --folds --prefetch`: the sum kernel as the batch-1 step runs it, each tile in a CUDA graph "
          f"over weight copies larger than L2; HBM copy {fo['ceilings']['hbm_copy_gbps']:,.0f} GB/s): the fold entries "
          f"s29c shipped against the sweep's best, us:\n")
    print("| projection | fold | shipped tile | us | best tile | us | written |\n|---|---|---|---|---|---|---|")
    for shape in dict.fromkeys(r["shape"] for r in fo["results"]):
        rs = [r for r in fo["results"] if r["shape"] == shape and "us" in r]
        base_r = next(r for r in rs if r["impl"].startswith("shipped"))
        best = min(rs, key=lambda r: r["us"])
        key = f"{base_r['n']},{base_r['k']},m1,{base_r['fold']}"
        written = fo["table"].get(key) == best["config"] and best is not base_r
        print(f"| {shape} | {base_r['fold']} | {tile(base_r['config'])} | {base_r['us']:.2f} | {tile(best['config'])} "
              f"| {best['us']:.2f} | {'yes' if written else 'no'} |")
    print("\nThe batch-1 loops at temperature 1 with that table (new) and with s29c's (old), one process each, in the "
          "order new, old, new (s30a; the skinny kernel's and the norm fold's GPU tests with the new table: `"
          + (B / base / "s30a/gpu_tests.txt").read_text().strip().splitlines()[-1] + "`):\n")
    _loop_arms(f"{base}/s30a", [("new", 1), ("old", 2), ("new", 3)])
    sw = load(f"{base}/s29d/decode_b1.json")
    print(f"\nThe decode kernel at one row (s29d, machine 1, `sweep_decode.py --shapes 1x8192,1x32768 --splits "
          f"0,16,24,32,48,128 --kv bf16 --prefetch`: decode and merge in a CUDA graph over 12 layers' pools, us a "
          f"layer; HBM copy {sw['ceilings']['hbm_copy_gbps']:,.0f} GB/s), the engine's tile and split count against "
          f"the sweep's best:\n")
    print("| context | engine's tile | us | of floor | best | us | of floor |\n|---|---|---|---|---|---|---|")
    for ctx in (8192, 32768):
        rs = [r for r in sw["rows"] if r["context"] == ctx and r.get("us")]
        eng = next(r for r in rs if r["engine"])
        best = min(rs, key=lambda r: r["us"])
        print(f"| {ctx} | {tuple(eng['tile'])} | {eng['us']:.1f} | {eng['of_floor']:.0%} | {tuple(best['tile'])}, "
              f"splits {best['splits'] or 'engine'}{', prefetch' if best['prefetch'] else ''} | {best['us']:.1f} | "
              f"{best['of_floor']:.0%} |")
    se = load(f"{base}/s30c/decode_early.json")
    print("\nThe same sweep with each split's first tile read before the PDL wait (K and V, no register limit) and "
          "after it (s30c, machine 2, `sweep_decode.py --early`), tile (64, 4, 2), us a layer, by split count "
          "(engine: decode_splits' 64 at one row):\n")
    print("| rows x context | engine, after | engine, before | 48, after | 48, before | 128, after | 128, before |\n"
          "|---|---|---|---|---|---|---|")
    for b, ctx in dict.fromkeys((r["batch"], r["context"]) for r in se["rows"]):
        cells = []
        for sp in (0, 48, 128):
            for e in (False, True):
                r = next((r for r in se["rows"] if (r["batch"], r["context"]) == (b, ctx) and r["splits"] == sp
                          and r["early"] == e and tuple(r["tile"]) == (64, 4, 2) and r.get("us")), None)
                cells.append(f"{r['us']:.1f}" if r else "-")
        print(f"| {b}x{ctx} | " + " | ".join(cells) + " |")
    print("\nThe batch-1 loops with the decode kernel's first tile read before its PDL wait (decode.EARLY_TILE), one "
          "process an arm, in order, at temperature 1, ms a step (of the floor). off: after the wait (as shipped); "
          "kv: K and V before it, the compiler's registers (157: 3 programs an SM); k: K alone (118); kv128: K and V "
          "held at 128 registers (4 an SM); t32, w8: kv with the few-row tile (32, 4, 2) or (64, 8, 2); s48: kv with "
          "3 waves of programs (49 splits at 8k):\n")
    for call, arms, note in (
            ("s30b", [("off", 1), ("on", 2), ("t32", 3), ("w8", 4), ("s48", 5), ("off", 6), ("on", 7)],
             "machine 2; on = kv"),
            ("s30d", [("off", 1), ("k", 2), ("kv", 3), ("off", 4), ("k", 5), ("kv", 6)], "machine 3"),
            ("s30e", [("off", 1), ("kv", 2), ("off", 3), ("kv", 4)], "machine 4; kv = kv128")):
        print(f"{call} ({note}):\n")
        _loop_arms(f"{base}/{call}", arms)
        print()
    for call, what in (("s30c", "the decode kernel's GPU tests, then the graphs' (K and V early by default then)"),
                       ("s30d", "the graphs' PDL-changes-no-bit test first (K early by default then), then the engine "
                        "against transformers")):
        dots = (B / base / f"{call}/gpu_tests.txt").read_text().strip()
        print(f"- {call}, {what}: {dots.count('.')} passed, {dots.count('F')} failed before the stage's timeout "
              f"stopped pytest (no summary line)")


def _loop_arms(folder: str, arms: list[tuple[str, int]]) -> None:
    """The async loops of bench_steps.py runs named loop_<i>_<arm>.json: a row per loop case, a column per arm."""
    data = [{r["case"]: r for r in load(f"{folder}/loop_{i}_{a}.json")["loops"] if r["async"]} for a, i in arms]
    print("| loop | " + " | ".join(f"{a} ({i})" for a, i in arms) + " |\n|---|" + "---|" * len(arms))
    for case in data[0]:
        print(f"| {case} | " + " | ".join(f"{d[case]['step_ms']:.2f} ({d[case]['fraction_of_floor']:.0%})"
                                          for d in data) + " |")


def _arm_ab(folder: str, arms: list[tuple[str, int]], tried: tuple[str, ...]) -> None:
    """_loop_arms' table, then each tried arm's mean step less the off arms' mean, per loop case."""
    _loop_arms(folder, arms)
    means = _arm_means(folder, arms)
    print()
    for arm in tried:
        print(f"- {arm} - off, the mean of each arm's two: " + ", ".join(
            f"{case} {m[arm] - m['off']:+.3f} ms" for case, m in means.items()))


def _arm_means(folder: str, arms: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
    """The async loops of _loop_arms' runs: per loop case, each arm's mean step ms over its runs."""
    data = [{r["case"]: r["step_ms"] for r in load(f"{folder}/loop_{i}_{a}.json")["loops"] if r["async"]}
            for a, i in arms]
    out: dict[str, dict[str, float]] = {}
    for case in data[0]:
        for arm in dict.fromkeys(a for a, _ in arms):
            xs = [d[case] for d, (a, _) in zip(data, arms) if a == arm]
            out.setdefault(case, {})[arm] = sum(xs) / len(xs)
    return out


def session29() -> None:
    """Session 29 (machines 1-4: an H200, two 2xH200s, an H200): decoders under long prompts through 1P1D deployments; where the
    batch-1 step's kernels go, by kind; the folded one-row products' own tiles; the side by side at the session's
    code."""
    base = "lease_s29"
    print("Decoders under a stream of long prompts through 1P1D deployments on both GPUs (pd_interfere/, machine 2, "
          "`INTERF_ARMS=\"pd-vllm pd-pdserve\" lease_2xh200.sh interfere`, code 79d7b0e): vLLM 0.22 with NixlConnector "
          "behind the anchors' proxy (prefill on GPU 0, decode on GPU 1), then `pdserve serve --prefill 1 --decode 1`. "
          "Decoders: 1024 in / 1024 out, 128 prompts at concurrency 32, alone, then again with 8 prompts of 32768 "
          "tokens (1 out) sent one at a time from 8 s after them; vLLM's client:\n")
    interference_table(f"{base}/pd_interfere")
    lin = load(f"{base}/s29a/linear.json")
    print(f"\nThe one-row products alone (s29a, machine 1, `bench_linear.py --rows 1 --sweep`: each timed in a CUDA graph "
          f"over weight copies larger than L2; HBM copy {lin['ceilings']['hbm_copy_gbps']:,.0f} GB/s in the same run), "
          f"cuBLAS against the sweep's best tile of the skinny kernel (plain products: no fold):\n")
    print("| projection | cuBLAS us | best skinny us | its GB/s | its tile |\n|---|---|---|---|---|")
    alone = {}
    for shape in dict.fromkeys(r["shape"] for r in lin["results"]):
        rs = [r for r in lin["results"] if r["shape"] == shape and r["rows"] == 1 and "us" in r]
        cb = next(r for r in rs if r["impl"] == "cublas")
        best = min((r for r in rs if r["impl"].startswith("skinny")), key=lambda r: r["us"])
        alone[shape] = best["us"]
        c = best["config"]
        print(f"| {shape} | {cb['us']:.2f} | {best['us']:.2f} | {best['gbps']:,.0f} | {c['kind']} {c['block_n']}x"
              f"{c['block_k']}, {c['num_warps']} warps, {c['num_stages']} stages |")
    kinds = ["q/k/v (norm's scale in)", "o (residual add, norm's parts out)", "gate_up (norm's scale in)",
             "down (activation in, norm's parts out)", "LM head"]
    runs = [("PDL off, 8k", "slots_pdl_off.json", 0), ("PDL off, 32k", "slots_pdl_off.json", 1),
            ("PDL early (shipped), 8k", "slots_pdl_early.json", 0)]
    print("\nThe batch-1 loop's kernels by kind (s29b, machine 3: GPU 0 of a 2xH200, `bench_steps.py "
          "--profile-loop` at temperature 1, 40 steps; each per-layer kernel's launches averaged by their position in "
          "the step, us a launch; with PDL off a kernel's time is its own, with PDL early it holds its wait for the "
          "kernel before):\n")
    print("| kernel | alone (s29a) | " + " | ".join(r[0] for r in runs) + " |\n|---|---|" + "---|" * len(runs))
    profs = []
    for _, f, i in runs:
        loops = [r for r in load(f"{base}/s29b/{f}")["loops"] if "profile" in r]
        profs.append(loops[i]["profile"])
    def slots(prof, name):
        return next(t["slots_us"] for t in prof["top"] if t["name"] == name)
    for i, kind in enumerate(kinds):
        cells = []
        for prof in profs:
            sl = slots(prof, "_skinny_sum_kernel")
            xs = sl[i:144:4] if i < 4 else sl[144:]
            cells.append(f"{sum(xs) / len(xs):.2f}")
        ref = alone[["qkv", "o", "gate_up", "down", "lm_head"][i]]
        print(f"| {kind} | {ref:.2f} | " + " | ".join(cells) + " |")
    for name in ("_decode_kernel", "_merge_kernel", "_qk_norm_rope_kernel"):
        cells = [f"{sum(slots(p, name)) / len(slots(p, name)):.2f}" for p in profs]
        print(f"| {name} | | " + " | ".join(cells) + " |")
    for (label, f, i), prof in zip(runs, profs):
        loops = [r for r in load(f"{base}/s29b/{f}")["loops"] if "profile" in r]
        print(f"- {label}: {loops[i]['step_ms']:.2f} ms a step under the profiler, {prof['kernels_per_step']:.0f} "
              f"kernels, {prof['gpu_us_per_step'] / 1e3:.2f} ms of kernel time a step")
    fo = load(f"{base}/s29c/folds.json")
    print(f"\nThe folded products' own tiles (s29c, machine 4, an H200, `bench_linear.py --folds`: the sum kernel "
          f"as the batch-1 step runs it, each tile in a CUDA graph over weight copies larger than L2; HBM copy "
          f"{fo['ceilings']['hbm_copy_gbps']:,.0f} GB/s): the shipped plain tile against the sweep's best, us:\n")
    print("| projection | fold | shipped tile | us | best tile | us | written |\n|---|---|---|---|---|---|---|")
    def tile(c):
        return f"{c['block_n']}x{c['block_k']}, {c['num_warps']}w {c['num_stages']}s"
    for shape in dict.fromkeys(r["shape"] for r in fo["results"]):
        rs = [r for r in fo["results"] if r["shape"] == shape and "us" in r]
        base_r = next(r for r in rs if r["impl"].startswith("shipped"))
        best = min(rs, key=lambda r: r["us"])
        key = f"{base_r['n']},{base_r['k']},m1,{base_r['fold']}"
        print(f"| {shape} | {base_r['fold']} | {tile(base_r['config'])} | {base_r['us']:.2f} | {tile(best['config'])} "
              f"| {best['us']:.2f} | {'yes' if key in fo['table'] else 'no'} |")
    print("\nThe batch-1 loops at temperature 1 with the measured fold entries (new) and as shipped before (old), one "
          "process each, in the order new, old, new (s29c, machine 4; the skinny kernel's and the norm fold's GPU "
          "tests with the new table: `" + (B / base / "s29c/gpu_tests.txt").read_text().strip().splitlines()[-1]
          + "`):\n")
    arms = [("new", 1), ("old", 2), ("new", 3)]
    print("| loop | " + " | ".join(f"{a} ({i}) ms (of floor)" for a, i in arms) + " |\n|---|---|---|---|")
    data = [{r["case"]: r for r in load(f"{base}/s29c/loop_{i}_{a}.json")["loops"] if r["async"]} for a, i in arms]
    for case in data[0]:
        print(f"| {case} | " + " | ".join(f"{d[case]['step_ms']:.2f} ({d[case]['fraction_of_floor']:.0%})"
                                          for d in data) + " |")
    sbs = f"{base}/sbs"
    print(f"\nOne GPU each at once at the session's engine code (sbs/, machine 3, "
          f"`SBS_WORKLOADS=... SBS_ROUNDS=1 SBS_CLIENTS=vllm lease_2xh200.sh sbs`, engine code 79d7b0e, before the fold "
          f"tiles; kernels pdserve compiled while serving: {_compiles(f'{sbs}/pdserve.log.gz')}), vLLM's client. The "
          f"256-token runs follow the 16-token runs of the same length and seed: prefix-cache hits on both servers, "
          f"so their TTFT is not a prefill and their TPOT is one request's steady pace:\n")
    _sbs_table(sbs)
    print()
    for w in ("8192x16_c1", "32768x16_c1", "8192x256_c1", "32768x256_c1"):
        _sbs_chunks(sbs, w)
    last = (B / base / "s28d/gpu_tests.txt").read_text().strip().splitlines()[-1]
    print(f"\n- the library prefill's GPU tests and the warm-up's plan test with its shifted-chunk case (s28d, machine 1, "
          f"code 79d7b0e): `{last}`")


def session28() -> None:
    """Session 28 (one H200, two 2xH200 machines, one H200): the library (cuDNN) prefill against the Triton kernel on
    chunks of 256-2048 tokens on prefixes; decoders under a stream of long prompts with cuDNN from 1024 tokens."""
    base = "lease_s28"
    print("A chunk of a long prompt as one engine step (`bench_steps.py --prefill C+N`: N new tokens on C cached, "
          "dummy Qwen3-8B, one H200; s28a and s28b are separate calls, each arm a fresh process): cuDNN's prefill "
          "(PDSERVE_PREFILL_LIBRARY_MIN_CHUNK set low enough) against the Triton kernel (as shipped then, MIN_CHUNK "
          "4096), median step ms and the matmul floor's share:\n")
    print("| call | step | path | cuDNN ms | Triton ms | Triton / cuDNN | cuDNN of floor | Triton of floor |\n"
          "|---|---|---|---|---|---|---|---|")
    for call, lib in (("s28a", "lib2048"), ("s28b", "lib256")):
        a = {r["case"]: r for r in load(f"{base}/{call}/chunks_{lib}.json")["results"]}
        b = {r["case"]: r for r in load(f"{base}/{call}/chunks_shipped.json")["results"]}
        for case, r in a.items():
            t = b[case]
            print(f"| {call} | {case.split(':', 1)[1]} | {r['path']} | {r['step_ms_median']:.2f} | "
                  f"{t['step_ms_median']:.2f} | {t['step_ms_median'] / r['step_ms_median']:.2f} | "
                  f"{r['fraction_of_floor']:.0%} | {t['fraction_of_floor']:.0%} |")
    print("\n(24576+8192 and 16384+4096 take cuDNN in both arms: the controls.)")
    for folder, note in (("interfere", "round 1, code 83bfe4e: cuDNN from 1024 tokens on a prefix, start-up building "
                          "the cap's chunk shapes"),
                         ("interfere_r2", "round 2, another machine, code 332e43e (round 1's engine and a test stage): "
                          "the cap 1024 arm left out")):
        print(f"\nDecoders under a stream of long prompts ({folder}/, `lease_2xh200.sh interfere`; {note}). "
              f"Decoders: 1024 in / 1024 out, 128 prompts at concurrency 32, alone, then again with 8 prompts of 32768 "
              f"tokens (1 out) sent one at a time from 8 s after them; vLLM on GPU 0, the pdserve arms "
              f"(--max-long-prefill-tokens N) one after the other on GPU 1; vLLM's client; kernels pdserve compiled "
              f"while serving, by arm: "
              + ", ".join(f"{p.name.split('.')[0].split('_')[1]}: {_compiles(str(p.relative_to(B)))}"
                          for p in sorted((B / base / folder).glob("pdserve_*.log.gz"))) + "\n")
        interference_table(f"{base}/{folder}")
    print()
    for rel, what in (("s28c/fixed.txt", "the merge kernel is one binary for any chunk length and offset (s28c)"),
                      ("s28c/reverted.txt", "the same test with the kernel's decorator reverted (s28c; it should fail)"),
                      ("s28d/gpu_tests.txt", "the library prefill's GPU tests and long prompts after the warm-up "
                       "building no cuDNN plan (s28d, code c185831)")):
        last = (B / base / rel).read_text().strip().splitlines()[-1]
        print(f"- {what}: `{last}`")


def interference_table(folder: str) -> None:
    """interference.sh's table (it prints it too, for its folder: an absolute path goes as it is): each arm's decoders alone and with the long stream, the long prompts' TTFT, and how
    many seconds of the long stream's run fell inside the decoders' (the results' end times, to a second)."""
    import datetime

    def span(r):
        end = datetime.datetime.strptime(r["date"], "%Y%m%d-%H%M%S").timestamp()
        return end - r["duration"], end

    deep = any("p99.9_itl_ms" in load(str(p)) for p in (B / folder).glob("*_dec_*.json"))
    itl = "median / p90 / p99 / p99.9" if deep else "median / p90 / p99"  # p99.9 from session 28
    print(f"| server | decoders | out tok/s | mean TPOT ms | {itl} ITL ms | long prompts' mean / median "
          "TTFT ms | overlap s |\n|---|---|---|---|---|---|---|")
    names = {"vllm": "vllm", "pd-vllm": "vLLM 1P1D (NIXL, 2 GPUs)", "pd-pdserve": "pdserve --prefill 1 --decode 1"}
    tags = sorted({p.name.rsplit("_dec_alone", 1)[0] for p in (B / folder).glob("*_dec_alone.json")},
                  key=lambda t: (t.startswith("pd-"), t != "vllm" and t != "pd-vllm", int(t.split("_")[1]) if "_" in t else 0))
    for tag in tags:
        name = names.get(tag) or f"pdserve --max-long-prefill-tokens {tag.split('_')[1]}"
        long = load(f"{folder}/{tag}_long.json") if (B / folder / f"{tag}_long.json").exists() else None
        for phase in ("alone", "with_long"):
            if not (B / folder / f"{tag}_dec_{phase}.json").exists():  # that run failed (its .txt says why)
                print(f"| {name} | {phase.replace('_', ' ')} | missing | | | | |")
                continue
            r = load(f"{folder}/{tag}_dec_{phase}.json")
            lt = ov = ""
            if phase == "with_long" and long:
                lt = f"{long['mean_ttft_ms']:.0f} / {long['median_ttft_ms']:.0f}"
                (a0, a1), (b0, b1) = span(r), span(long)
                ov = f"{max(0.0, min(a1, b1) - max(a0, b0)):.0f} of {b1 - b0:.0f}"
            ps = ("median", "p90", "p99", "p99.9") if deep else ("median", "p90", "p99")
            itls = " / ".join(f"{r[p + '_itl_ms']:.1f}" for p in ps)
            print(f"| {name} | {phase.replace('_', ' ')} | {r['output_throughput']:,.1f} | {r['mean_tpot_ms']:.2f} | "
                  f"{itls} | {lt} | {ov} |")


def session26() -> None:
    """Session 26 (one 2xH200 machine): 1P1D against vLLM's 1P1D with the router's new default, two rounds, vLLM's
    client; the single-GPU side by side; the processes' start-up heaps frozen and not, with their collectors' pauses."""
    base = "lease_s26"
    print("1P1D on 2xH200 (`lease_2xh200.sh pd_one`, PD_MODE=pd-pdserve then pd-vllm, twice: pd/ is round 1, pd_r2/ "
          "round 2; code f6d7c7c: the router's local-prefill fallback off, the start-up heaps frozen): `pdserve serve "
          "--prefill 1 --decode 1` (cuda_ipc) against vLLM 0.22 with NixlConnector behind the anchors' proxy; dummy "
          "Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both:\n")
    pairs = _pd_rounds(lambda r, n, w: f"{base}/{'pd' if r == '1' else 'pd_r2'}/{n}_pd_{w}.json")
    for r in ("1", "2"):
        v, p = pairs[(r, "1024x1024_c256")]
        print(f"- round {r}, 1024x1024_c256 inter-token latency median / p99: vLLM {v['median_itl_ms']:.1f} / "
              f"{v['p99_itl_ms']:.1f} ms, pdserve {p['median_itl_ms']:.1f} / {p['p99_itl_ms']:.1f} ms")
    for r, folder in (("1", "pd"), ("2", "pd_r2")):
        v, p = (load(f"{base}/{folder}/{n}_pd_server.json") for n in ("vllm", "pdserve"))
        print(f"- round {r}, start-up (launch to first completion through the proxy or router): vLLM "
              f"{v['startup_s']:.1f} s, pdserve {p['startup_s']:.1f} s; KV tokens (from the logs): vLLM "
              f"{v['kv_tokens']:,}, pdserve {p['kv_tokens']:,}")
    print(f"\nOne GPU each at once (sbs/, the same machine, `lease_2xh200.sh sbs`, code f6d7c7c; kernels pdserve compiled "
          f"while serving: {_compiles(f'{base}/sbs/pdserve.log.gz')}), vLLM's client, round 1:\n")
    _sbs_table(f"{base}/sbs")
    v2, p2 = (load(f"{base}/sbs/{n}_single_1024x1024_c256_r2.json") for n in ("vllm", "pdserve"))
    print(f"\nRound 2 of 1024x1024_c256 by vLLM's client: vLLM {v2['output_throughput']:,.1f}, pdserve "
          f"{p2['output_throughput']:,.1f} out tok/s ({p2['output_throughput'] / v2['output_throughput']:.3f}x); mean TPOT "
          f"{v2['mean_tpot_ms']:.2f} / {p2['mean_tpot_ms']:.2f} ms; mean TTFT {v2['mean_ttft_ms']:.0f} / "
          f"{p2['mean_ttft_ms']:.0f} ms.")
    print("\nThe start-up heaps frozen (pdserve.gc_heap, as shipped) and not (`PDSERVE_GC_FREEZE=0`), the 1P1D deployment "
          "one after the other (pd_gc/, `PD_ARMS=\"shipped nofreeze\" GC_PROBE=1 lease_2xh200.sh pd_policy`; pdserve's "
          "client, 1024/1024 c256; every process logged its collector's pauses, benchmarks/debug/gc_probe):\n")
    print("| arm | out tok/s | mean / median / p90 TTFT ms | mean TPOT ms | median / p99 ITL ms |\n|---|---|---|---|---|")
    for arm in ("shipped", "nofreeze"):
        d = load(f"{base}/pd_gc/{arm}.json")
        print(f"| {arm} | {d['output_throughput']:,.1f} | {d['mean_ttft_ms']:.0f} / {d['median_ttft_ms']:.0f} / "
              f"{d['p90_ttft_ms']:.0f} | {d['mean_tpot_ms']:.2f} | {d['median_itl_ms']:.1f} / {d['p99_itl_ms']:.1f} |")
    print("\nFull (generation 2) collections in each process between the probe's summary lines that bracket the run "
          "(the lines are written at most every 5 s, at a collection, so a bracket starts up to ~17 s before the run's "
          "first request and ends up to ~2 s after its last; * : the freeze's own collection falls in it):\n")
    print("| process | frozen: collections / ms in all | not frozen: collections / ms in all |\n|---|---|---|")
    rows = {arm: _gc_bracket(f"{base}/pd_gc", arm) for arm in ("shipped", "nofreeze")}
    for name in rows["shipped"]:
        cells = []
        for arm in ("shipped", "nofreeze"):
            n, ms, froze = rows[arm].get(name, (0, 0.0, False))
            cells.append(f"{n} / {ms:.1f}{' *' if froze else ''}")
        print(f"| {name} | {' | '.join(cells)} |")


def _pd_rounds(path: Callable[[str, str, str], str], criterion: bool = False) -> dict:
    """Two rounds of 1P1D against vLLM's 1P1D (`lease_2xh200.sh pd_one`, vLLM's client): a row per round and
    workload (`path(round, server, workload)`: the client's JSON of server vllm or pdserve), then the c256 output
    over both rounds (with issue 10's criterion where `criterion`). Returns {(round, workload): (vllm, pdserve)}."""
    print("| round | workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean "
          "TPOT vLLM / pdserve ms | ratio |\n|---|---|---|---|---|---|---|---|---|")
    pairs = {}
    for r in ("1", "2"):
        for w in ("1024x1024_c256", "8192x16_c1"):
            v, p = (load(path(r, n, w)) for n in ("vllm", "pdserve"))
            pairs[(r, w)] = (v, p)
            print(f"| {r} | {w} | {_sbs_cells(v, p)}")
    big = [pairs[(r, "1024x1024_c256")] for r in ("1", "2")]
    mean = [sum(x[i]["output_throughput"] for x in big) / 2 for i in (0, 1)]
    verdict = f"; issue 10 asks >= 1.0: {'met' if mean[1] >= mean[0] else 'not met'}" if criterion else ""
    print(f"\n- 1024x1024_c256 over both rounds: vLLM {mean[0]:,.1f}, pdserve {mean[1]:,.1f} out tok/s "
          f"({mean[1] / mean[0]:.3f}x{verdict})")
    return pairs


def _gc_bracket(folder: str, arm: str) -> dict[str, tuple[int, float, bool]]:
    """Per process of a pd_policy arm run under benchmarks/debug/gc_probe: (full collections, their ms in all, whether
    the freeze's collection is among them) between the summary lines that bracket the run (its window from the
    result's end time and duration); processes named by role (the lower pid of a role is its server, the higher its
    engine process; `pdserve serve` is the launcher, which runs the router)."""
    import datetime
    d = load(f"{folder}/{arm}.json")
    end = datetime.datetime.strptime(d["date"], "%Y%m%d-%H%M%S").replace(tzinfo=datetime.timezone.utc).timestamp()
    start = end - d["duration"]
    seen: dict[str, int] = {}
    out: dict[str, tuple[int, float, bool]] = {}
    for p in sorted((B / folder / f"gc_{arm}").glob("*.log"), key=lambda p: int(p.stem)):
        rows = []
        for line in p.read_text().splitlines():
            m = re.match(r"([\d.]+) (.*?) frozen=(\d+) \| (.*)", line)
            if m:
                g2 = re.search(r"gen2: n=(\d+) total=([\d.]+)ms", m.group(4))
                rows.append((float(m.group(1)), m.group(2), int(m.group(3)),
                             (int(g2.group(1)), float(g2.group(2))) if g2 else (0, 0.0)))
        role = re.search(r"--role (\w+)", rows[0][1]) if rows else None
        if not rows or not (role or "pdserve serve" in rows[0][1]):
            continue  # a helper process (multiprocessing's resource tracker)
        kind = role.group(1) if role else "launcher + router"
        if role:
            seen[kind] = seen.get(kind, 0) + 1
            kind = f"{kind} {'server' if seen[kind] == 1 else 'engine'}"
        before = [r for r in rows if r[0] <= start]
        last = [r for r in rows if r[0] <= end + 6][-1]
        first = before[-1] if before else (0.0, "", last[2], (0, 0.0))
        out[kind] = (last[3][0] - first[3][0], last[3][1] - first[3][1], first[2] != last[2])
    return out


def session25() -> None:
    """Session 25 (two 2xH200 machines): 1P1D against vLLM's 1P1D with NIXL, both measured by vLLM's client, then
    the router's local-prefill fallback as shipped and off, measured by pdserve's client."""
    base = "lease_s25"
    print("1P1D, one prefill and one decode instance on 2xH200 (pd/, machine 1, `lease_2xh200.sh pd_one`, "
          "PD_MODE=pd-pdserve then pd-vllm, at bf230a5): `pdserve serve --prefill 1 --decode 1` (cuda_ipc between "
          "the instances) against vLLM 0.22 with NixlConnector behind the anchors' proxy; dummy Qwen3-8B bf16, "
          "--gpu-memory-utilization 0.9; vLLM's `bench serve` on both:\n")
    print("| workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean TPOT "
          "vLLM / pdserve ms | ratio |\n|---|---|---|---|---|---|---|---|")
    for w in ("1024x1024_c256", "8192x16_c1"):
        v, p = (load(f"{base}/pd/{n}_pd_{w}.json") for n in ("vllm", "pdserve"))
        print(f"| {w} | {_sbs_cells(v, p)}")
    v, p = (load(f"{base}/pd/{n}_pd_1024x1024_c256.json") for n in ("vllm", "pdserve"))
    print(f"\n- 1024x1024_c256, inter-token latency median / p99: vLLM {v['median_itl_ms']:.1f} / "
          f"{v['p99_itl_ms']:.1f} ms, pdserve {p['median_itl_ms']:.1f} / {p['p99_itl_ms']:.1f} ms")
    v, p = (load(f"{base}/pd/{n}_pd_server.json") for n in ("vllm", "pdserve"))
    print(f"- start-up (launch to first completion through the proxy or router): vLLM {v['startup_s']:.1f} s, "
          f"pdserve {p['startup_s']:.1f} s")
    print("\nWhy pdserve's decode instance stalled (a p99 inter-token latency of a prefill chunk's step): the router "
          "counted a prefill instance with more than --prefill-max-waiting-tokens (then 32768) queued as full and "
          "prefilled the prompt on the decode instance. The same deployment with that fallback as shipped and off "
          "(`--prefill-max-waiting-tokens 1000000000`: every prompt prefilled remotely, as vLLM's proxy does), one "
          "after the other on machine 2 (pd_policy/, `lease_2xh200.sh pd_policy`, at bf230a5; pdserve's client, "
          "1024/1024 c256; the router's counters read after each run):\n")
    print("| arm | out tok/s | mean / median / p90 TTFT ms | mean TPOT ms | median / p99 ITL ms | requests "
          "prefilled remotely / on the decode instance (busy, short) |\n|---|---|---|---|---|---|")
    for arm in ("shipped", "always"):
        d = load(f"{base}/pd_policy/{arm}.json")
        counts = {}
        for line in (B / base / "pd_policy" / f"router_metrics_{arm}.txt").read_text().splitlines():
            m = re.match(r'pdserve:router_(requests|local_prefill)_total\{(?:mode="(\w+)",outcome="ok"|reason="(\w+)")\} '
                         r'([\d.]+)', line)
            if m:
                counts[m.group(2) or m.group(3)] = int(float(m.group(4)))
        print(f"| {arm} | {d['output_throughput']:,.1f} | {d['mean_ttft_ms']:.0f} / {d['median_ttft_ms']:.0f} / "
              f"{d['p90_ttft_ms']:.0f} | {d['mean_tpot_ms']:.2f} | {d['median_itl_ms']:.1f} / {d['p99_itl_ms']:.1f} | "
              f"{counts.get('pd', 0)} / {counts.get('local', 0)} ({counts.get('prefill_busy', 0)}, "
              f"{counts.get('short', 0)}) |")
    a, b = (load(f"{base}/pd_policy/{arm}.json") for arm in ("shipped", "always"))
    print(f"\nOff against shipped: {b['output_throughput'] / a['output_throughput']:.3f}x the output tok/s, mean TPOT "
          f"{b['mean_tpot_ms'] / a['mean_tpot_ms']:.3f}x, mean TTFT {b['mean_ttft_ms'] / a['mean_ttft_ms']:.3f}x. The "
          "router's default is now off (RouterConfig.prefill_max_waiting_tokens = 0). The device time ran out before the "
          "new default could be measured beside vLLM's 1P1D: the comparison above is the shipped arm's.")


def session24() -> None:
    """Session 24 (one H200 at a time): the add+RMSNorm folded into the one-row products around it, the batch-1
    loop's kernels, the side by side with stream metrics, and prefill alone (one output token) against vLLM."""
    base = "lease_s24"
    print(f"The add+RMSNorm folded into the one-row products around it (pdserve.ops.norm_fold; s24a, machine 1; GPU "
          f"tests of the kernels, the engine against transformers and the warm-up burst: "
          f"{_pytest_verdict(f'{base}/s24a/gpu_tests.txt')}); the batch-1 loops at temperature 1, fold on and off "
          "(`--no-fold-norm`), order on, off, on, off:\n")
    _ab_steps([(v, load(f"{base}/s24a/loop_{v}.json")) for v in ("on1", "off1", "on2", "off2")])
    lp = next(x for x in load(f"{base}/s24b/profile.json")["loops"] if x.get("profile"))
    pr, gpu = lp["profile"], lp.get("gpu", {})
    print(f"\nThe batch-1 8k loop at temperature 1 under the profiler with the fold (s24b, machine 2; {lp['step_ms']:.2f} "
          f"ms a step, {pr['kernels_per_step']:.0f} kernels a step, GPU busy {gpu.get('busy_us_per_step', 0) / 1e3:.2f} "
          f"ms and idle {gpu.get('idle_us_per_step', 0) / 1e3:.2f} ms a step; under programmatic dependent launch a "
          "kernel's time includes its wait for the one before, so the times overlap and their sum is not the step):\n")
    print("| kernel | per step | us a step |\n|---|---|---|")
    for k in pr["top"][:8]:
        print(f"| {k['name'][:60]} | {k['count_per_step']:.0f} | {k['us_per_step']:.0f} |")
    print("\nSide by side with vLLM 0.22 (sbs/, machine 2, `lease_1gpu.sh sbs` at 30b56bd: vLLM, then pdserve, on the "
          "one H200; dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both, no temperature "
          f"sent: both sample at 1.0; kernels pdserve compiled while serving: {_compiles(f'{base}/sbs/pdserve.log.gz')}):\n")
    _sbs_table(f"{base}/sbs")
    print("\nThe one-at-a-time streams (compare.py's stream metrics from the per-request lists: first-chunk tokens is "
          "output tokens less the gaps between chunks; the steady gap is the median of each request's gaps longer "
          "than 0.5 ms):\n")
    print("| workload | server | mean TTFT ms | mean TPOT ms | mean E2E ms | chunks a request | first-chunk tokens | "
          "steady gap ms |\n|---|---|---|---|---|---|---|---|")
    for w in sorted(load(f"{base}/sbs/comparison.json")["workloads"], key=lambda w: w["workload"]):
        for n in ("vllm", "pdserve"):
            st = (w[n] or {}).get("stream")
            if not st:
                continue
            gap = f"{st['steady_gap_ms']:.2f}" if st.get("steady_gap_ms") is not None else "-"
            print(f"| {w['workload']} | {n} | {w[n]['mean_ttft_ms']:.1f} | {w[n]['mean_tpot_ms']:.2f} | "
                  f"{st['mean_e2el_ms']:.1f} | {st['chunks_per_request']:.1f} | {st['first_chunk_tokens']:.1f} | {gap} |")
    print("\nPrefill alone: one output token, so TTFT is the whole request and no stream can bunch (sbs_prefill/, the "
          "same machine right after, fresh servers, `SBS_WORKLOADS=\"8192:1:16:1 32768:1:4:1\"`); each run's first "
          "request re-sends a warm-up prompt (a prefix-cache hit on both servers), so the misses are the requests "
          "after it:\n")
    print("| workload | vLLM mean TTFT ms | pdserve mean TTFT ms | ratio | vLLM misses ms | pdserve misses ms | ratio |\n"
          "|---|---|---|---|---|---|---|")
    for w in ("8192x1_c1", "32768x1_c1"):
        v, p = (load(f"{base}/sbs_prefill/{n}_single_{w}.json") for n in ("vllm", "pdserve"))
        mv, mp = _misses(v)[0], _misses(p)[0]
        print(f"| {w} | {v['mean_ttft_ms']:.1f} | {p['mean_ttft_ms']:.1f} | {p['mean_ttft_ms'] / v['mean_ttft_ms']:.3f} | "
              f"{mv:.1f} | {mp:.1f} | {mp / mv:.3f} |")
    for w in ("8192x16_c1", "32768x16_c1"):
        v, p = (load(f"{base}/sbs/{n}_single_{w}.json") for n in ("vllm", "pdserve"))
        (tv, ev), (tp, ep) = _misses(v), _misses(p)
        print(f"\n- {w}, the misses: vLLM TTFT {tv:.1f} ms and E2E {ev:.1f} ms; pdserve TTFT {tp:.1f} ms and E2E "
              f"{ep:.1f} ms (E2E ratio {ep / ev:.3f})", end="")
    print()


def session23() -> None:
    """Session 23 (H200s, one H100): the decode kernel's block table read a tile ahead, the KV write in the rotary
    kernel, the inverse-CDF sampling kernel, the side by side."""
    base = "lease_s23"
    print("Where the batch-256 decode kernel waits (s23b, machine 2, an H100, `ncu --clock-control none` on "
          "`benchmarks/attention/ncu_decode.py`: 256 rows x 1088 keys x 8 KV heads, the engine's (64, 4, 3) tile):\n")
    txt = (B / base / "s23b" / "ncu.txt").read_text()
    for key in ("DRAM Throughput", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Block Limit Registers",
                "Block Limit Shared Mem", "Achieved Occupancy", "Waves Per SM", "Warp Cycles Per Issued Instruction"):
        m = re.search(rf"{key}\s+(\S+)\s+([\d.,]+)", txt)
        if m:
            print(f"- {key}: {m.group(2)} {m.group(1) if not m.group(1)[0].isdigit() else ''}".rstrip())
    m = re.search(r"spends ([\d.]+) cycles being stalled waiting for a scoreboard dependency\s+on a L1TEX", txt)
    if m:
        print(f"- stalled on global loads (L1TEX scoreboard): {m.group(1)} of the cycles between two instructions")
    print("\nCompiled for sm_90 here (ptxas), the kernel's loop keeps one K/V tile in shared memory at any num_stages: "
          "the K/V addresses come from the block table loaded in the same step, and the pipeliner waits for every "
          "copy at the top of each step. With the next tile's page ids loaded a step ahead (a loop-carried value), "
          "num_stages - 1 tiles are in flight. The two kernels at 256 rows x 1088 keys (`probe_decode_variants.py`; "
          "s23f machine 3, s23g machine 4; two rounds each):\n")
    print("| run | kernel | tile | maxnreg | round | us a layer | of the copy rate |\n|---|---|---|---|---|---|---|")
    for run in ("s23f", "s23g"):
        for r in load(f"{base}/{run}/decode_variants.json")["rows"]:
            name = r.get("kernel", r["probe"])
            print(f"| {run} | {name} | {tuple(r['tile'])} | {r.get('maxnreg') or '-'} | {r['round']} | "
                  f"{r['us']:.1f} | {100 * r['of_copy']:.1f} % |")
    a = load(f"{base}/s23a/decode_variants.json")
    pers = [r for r in a["rows"] if r["probe"] == "persistent"]
    best = max(pers, key=lambda r: r["of_copy"])
    eng = next(r for r in a["rows"] if r["probe"] == "decode" and r.get("engine"))
    print(f"\nA persistent kernel walking its rows' tiles as one flattened loop (s23a, machine 1) reached at best "
          f"{100 * best['of_copy']:.1f} % ({best['per_sm']} programs an SM, {best['keys']} keys, {best['warps']} warps, "
          f"{best['stages']} stages) against the engine's {100 * eng['of_copy']:.1f} %; not pursued.")
    g = load(f"{base}/s23a/gemm_split.json")
    print(f"\nEvery decode product split over K, the GEMM alone (s23a, `probe_gemm_split.py`; bf16 matmul "
          f"{g['ceilings']['bf16_matmul_tflops']:.0f} TFLOP/s in the same run), us:\n")
    print("| product | rows | plain (TFLOP/s) | split 2 | split 3 | split 4 |\n|---|---|---|---|---|---|")
    for r in g["rows"]:
        sp = r["split_us"]
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['plain_us']:.2f} ({r['plain_tflops']:.0f}) | "
              + " | ".join(f"{sp[k]:.2f}" if k in sp else "-" for k in ("2", "3", "4")) + " |")
    print(f"\nGPU tests of the KV write in the rotary kernel (fp8 pools, graphs against eager with the Triton backend, "
          f"the warm-up burst; s23b, the H100): {_pytest_verdict(f'{base}/s23b/gpu_tests.txt')}; of the read-ahead "
          f"(decode kernel, warm-up; s23h, machine 5): {_pytest_verdict(f'{base}/s23h/gpu_tests.txt')}.")
    print("\nThe steady loops at temperature 1 with the read-ahead and the KV write in the rotary kernel (new) and "
          "with neither (old: `--no-decode-prefetch --no-kv-write-early`), s22's sampling kernel in both (s23h, "
          "machine 5, order new, old, new, old):\n")
    _ab_steps([(v, load(f"{base}/s23h/loop_{v}.json")) for v in ("new1", "old1", "new2", "old2")])
    print("\nThe KV write in the rotary kernel alone, on and off (`--no-kv-write-early`), the read-ahead on (s23d, the "
          "same machine):\n")
    _ab_steps([(v, load(f"{base}/s23d/loop_{v}.json")) for v in ("on1", "off1", "on2", "off2")])
    print(f"\nThe same on an H100 (s23h_h100, machine 7; the inverse-CDF sampler in both arms; GPU tests "
          f"{_pytest_verdict(f'{base}/s23h_h100/gpu_tests.txt')}):\n")
    _ab_steps([(v, load(f"{base}/s23h_h100/loop_{v}.json")) for v in ("new1", "old1", "new2", "old2")])
    e = load(f"{base}/s23e/sampler.json")
    print(f"\nThe inverse-CDF sampling kernel (s23e, machine 6; tests {_pytest_verdict(f'{base}/s23e/gpu_tests_sampling.txt')}"
          f"; the warm-up burst compiles nothing while serving: {_pytest_verdict(f'{base}/s23e/gpu_tests_warmup.txt')}). "
          "`bench_sampler.py`: the kernels alone in a CUDA graph, and the sampler with its host work, us (s22's Gumbel "
          "kernels alone: see Session 22):\n")
    print("| rows | kind | torch path | sampler | kernels alone |\n|---|---|---|---|---|")
    for r in e["results"]:
        ka = f"{r['kernel_graph_us']:.1f}" if "kernel_graph_us" in r else "-"
        print(f"| {r['rows']} | {r['kind']} | {r['torch_us']:.1f} | {r['kernel_us']:.1f} | {ka} |")
    print("\nThe session's code (aaef1e7) against the code it started from (de870cd's `pdserve/` first on PYTHONPATH in "
          "the `old` arms), s23c, machine 6, order new, old, new, old:\n")
    _ab_steps([(v, load(f"{base}/s23c/loop_{v}.json")) for v in ("new1", "old1", "new2", "old2")])
    lp = next(x for x in load(f"{base}/s23i/profile.json")["loops"] if x.get("profile"))
    pr = lp["profile"]
    print(f"\nThe batch-256 loop at temperature 1 under the profiler at aaef1e7 (s23i, machine 6; {lp['step_ms']:.2f} ms "
          f"a step, {pr['kernels_per_step']:.0f} kernels, {pr['gpu_us_per_step'] / 1e3:.2f} ms of kernels a step):\n")
    print("| kernel | per step | us a step | share |\n|---|---|---|---|")
    for k in pr["top"][:12]:
        print(f"| {k['name'][:60]} | {k['count_per_step']:.0f} | {k['us_per_step']:.0f} | {100 * k['share']:.1f} % |")
    print("\nSide by side with vLLM 0.22 (sbs/, machine 6, `lease_1gpu.sh sbs` at aaef1e7: vLLM, then pdserve, on the "
          "one H200; dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both, no temperature "
          f"sent: both sample at 1.0; kernels pdserve compiled while serving: {_compiles(f'{base}/sbs/pdserve.log.gz')}):\n")
    _sbs_table(f"{base}/sbs")
    for w in ("8192x16_c1", "32768x16_c1"):
        _sbs_chunks(f"{base}/sbs", w)


def session22() -> None:
    """Session 22 (H200s): o/down split over K with float32 parts summed by the next add+RMSNorm (the table, steps,
    loops), the batch-256 loop's kernels, the sampling kernel's per-lane bests, the side by side."""
    base = "lease_s22"
    d = load(f"{base}/s22a/split_k.json")
    c = d["ceilings"]
    print("A product and the add+RMSNorm after it, plain (the skinny kernel up to 16 rows, cuBLAS above, then the norm) "
          "against the product split over K into float32 parts that the norm sums (s22a, machine 1, "
          "`benchmarks/engine/bench_split_k.py`; graphs of pairs over weight copies larger than L2; same run: HBM copy "
          f"{c['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s), us, at a selection "
          "of the 41 row counts measured:\n")
    print("| projection | rows | plain | split 2 | split 3 | split 4 | best against plain |\n|---|---|---|---|---|---|---|")
    for r in d["results"]:
        if r["rows"] in (1, 16, 64, 128, 160, 192, 224, 256, 272, 320, 384, 512, 1024):
            sp = r["split_us"]
            print(f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['plain_us']:.2f} | "
                  + " | ".join(f"{sp[k]:.2f}" if k in sp else "-" for k in ("2", "3", "4"))
                  + f" | {100 * r['gain']:+.1f} % |")
    print("\nThe table it wrote (shipped as `pdserve/ops/configs/split_k/device=NVIDIA_H200.json`; [first row, last "
          "row, parts] where the split won by more than 3 %; an MLP of one row keeps its folded activation kernel and "
          "is never split):\n")
    for key, runs in d["table"].items():
        print(f"- {key}: {runs}")
    for m in (128, 192, 256, 384):
        pairs = [r for r in d["results"] if r["rows"] == m and r["n"] == 4096]
        before = sum(r["plain_us"] for r in pairs) * 36
        after = sum(r["best_us"] if r["gain"] > 0.03 else r["plain_us"] for r in pairs) * 36
        print(f"{'' if m != 128 else chr(10)}- Qwen3-8B at {m} rows, o + down with their norms over 36 layers: "
              f"{before / 1e3:.3f} -> {after / 1e3:.3f} ms a step")
    print(f"\nGPU tests (s22a): split products, norms and a tiny model through graphs with the split (-m gpu) "
          f"{_pytest_verdict(f'{base}/s22a/gpu_tests.txt')}; the sampling kernel (its per-row offsets changed after "
          f"s21's lease) {_pytest_verdict(f'{base}/s22a/gpu_tests_sampling.txt')}.\n")
    print("Whole steps and the steady loop at batch 256, temperature 1, with the measured table and `--no-split-k` "
          "(s22a, same call, order on, off, on, off; floor = weights + KV at the HBM rate):\n")
    _ab_steps([(v, load(f"{base}/s22a/steps_{v}.json")) for v in ("on1", "off1", "on2", "off2")])
    print("\nThe same loop on another machine (s22b, machine 2, order off, on, off, on):\n")
    _ab_steps([(v, load(f"{base}/s22b/loop_{v}.json")) for v in ("off1", "on1", "off2", "on2")])
    lp = next(x for x in load(f"{base}/s22b/profile.json")["loops"] if x.get("profile"))
    pr = lp["profile"]
    print(f"\nThe batch-256 loop at temperature 1 under the profiler with the split (s22b; {lp['step_ms']:.2f} ms a "
          f"step, {pr['kernels_per_step']:.0f} kernels, {pr['gpu_us_per_step'] / 1e3:.2f} ms of kernels a step; at "
          "256 rows the table splits down, not o):\n")
    print("| kernel | per step | us a step | share |\n|---|---|---|---|")
    for k in pr["top"][:12]:
        print(f"| {k['name'][:60]} | {k['count_per_step']:.0f} | {k['us_per_step']:.0f} | {100 * k['share']:.1f} % |")
    print("\nThe sampling kernel with per-lane bests (one reduction a program) against s21's (a block-wide max and "
          "argmax per 512 columns), s22c, machine 3, `bench_sampler.py`: the kernels alone in a CUDA graph at the "
          "default temperature, and `sample_async` with its host work, us:\n")
    print("| rows | kernels alone s21 | kernels alone now | sample_async s21 | sample_async now |\n|---|---|---|---|---|")
    old, new = (load(f"{base}/s22c/sampler_{v}.json")["results"] for v in ("old", "new"))
    for o, n in zip(old, new):
        if o["kind"] == "default (T=1)":
            print(f"| {o['rows']} | {o['kernel_graph_us']:.1f} | {n['kernel_graph_us']:.1f} | {o['kernel_us']:.1f} | "
                  f"{n['kernel_us']:.1f} |")
    print(f"\nTests (s22c): sampling kernel {_pytest_verdict(f'{base}/s22c/gpu_tests.txt')}; the warm-up burst "
          f"{_pytest_verdict(f'{base}/s22c/gpu_tests_warmup.txt')}. The loops at temperature 1, new kernel and s21's "
          "(order new, old, new, old):\n")
    _ab_steps([(v, load(f"{base}/s22c/loop_{v}.json")) for v in ("new1", "old1", "new2", "old2")])
    sw = load(f"{base}/s22e/sampler.json")["sweep"]
    print("\nThe sampling kernels alone at the default temperature per launch shape (s22e, machine 6, `bench_sampler.py "
          "--sweep`; programs per SM sets how far a row is split), us:\n")
    rows = sorted({r["rows"] for r in sw})
    print("| programs per SM | warps | " + " | ".join(f"{n} rows" for n in rows) + " |\n|---|---|"
          + "---|" * len(rows))
    for per_sm in sorted({r["programs_per_sm"] for r in sw}):
        for w in sorted({r["num_warps"] for r in sw}):
            cells = [next(r["us"] for r in sw if r["rows"] == n and r["programs_per_sm"] == per_sm
                          and r["num_warps"] == w) for n in rows]
            print(f"| {per_sm} | {w} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    f = load(f"{base}/s22f/sampler.json")["results"]
    alone = {r["rows"]: r["kernel_graph_us"] for r in f if "kernel_graph_us" in r}
    print("\nShipped: 8 warps, 4 programs per SM. At that code (s22f, machine 7): the kernels alone "
          + ", ".join(f"{v:.1f} us at {k} rows" for k, v in alone.items())
          + f"; sampling kernel tests {_pytest_verdict(f'{base}/s22f/gpu_tests.txt')}; the warm-up burst "
          f"{_pytest_verdict(f'{base}/s22f/gpu_tests_warmup.txt')}.")
    kv = load(f"{base}/s22e/kv_read.json")
    c = kv["ceilings"]
    a = kv["args"]
    print(f"\nReading a batch-256 decode step's KV (s22e, machine 6, `benchmarks/attention/probe_kv_read.py`: "
          f"{a['batch']} rows x {a['context']} keys x {a['hk']} KV heads x {a['head_dim']}, bf16, the engine's "
          f"head-major pool with random pages, {a['layers']} layers cycled; HBM copy {c['hbm_copy_gbps']:,.0f} GB/s "
          "in the same run), the best of each kind:\n")
    print("| probe | setting | us a layer | GB/s | of the copy rate |\n|---|---|---|---|---|")
    for probe in ("flat", "paged", "decode"):
        rs = [r for r in kv["rows"] if r["probe"] == probe]
        best = max(rs, key=lambda r: r["gbps"])
        picks = [best] + [r for r in rs if probe == "decode" and r.get("engine") and r is not best]
        for r in picks:
            setting = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("probe", "us", "gbps", "of_copy"))
            print(f"| {probe} | {setting} | {r['us']:.1f} | {r['gbps']:,.0f} | {100 * r['of_copy']:.1f} % |")
    print("\nThe decode kernel reads within a few percent of what a kernel that only reads the same pages reaches. "
          "Two splits a row at batch 256 (`--decode-waves 32`: 4,096 programs and the merge) against one (s22f, "
          "machine 7, order base, w32, base, w32):\n")
    _ab_steps([(v, load(f"{base}/s22f/loop_{v}.json")) for v in ("base1", "w32a", "base2", "w32b")])
    print("\nThe session's code against the code it started from (s22g, machine 8: 45e1c9d's `pdserve/` first on "
          "PYTHONPATH in the `old` arms; the split tables and the sampling kernel's changes are the difference; order "
          "new, old, new, old):\n")
    _ab_steps([(v, load(f"{base}/s22g/loop_{v}.json")) for v in ("new1", "old1", "new2", "old2")])
    h = load(f"{base}/s22d/split_k.json")
    print(f"\nThe same table measured on an H100 (s22d, machine 5, {h['ceilings']['gpu']}; HBM copy "
          f"{h['ceilings']['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {h['ceilings']['bf16_matmul_tflops']:.0f} TFLOP/s; "
          "shipped as `device=NVIDIA_H100_80GB_HBM3.json`; GPU tests of the split "
          f"{_pytest_verdict(f'{base}/s22d/gpu_tests.txt')}):\n")
    for key, runs in h["table"].items():
        print(f"- {key}: {runs}")
    print("\nThe batch-256 loop at temperature 1 on that H100, with its table and without:\n")
    _ab_steps([(v, load(f"{base}/s22d/loop_{v}.json")) for v in ("on1", "off1")])
    print("\nSide by side with vLLM 0.22 (sbs/, machine 4, `lease_1gpu.sh sbs`, the split table shipped, s21's "
          "sampling kernel: vLLM, then pdserve, on the one H200; dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; "
          "vLLM's `bench serve` on both, no temperature sent: both sample at 1.0; kernels pdserve compiled while "
          f"serving: {_compiles(f'{base}/sbs/pdserve.log.gz')}):\n")
    _sbs_table(f"{base}/sbs")
    for w in ("8192x16_c1", "32768x16_c1"):
        _sbs_chunks(f"{base}/sbs", w)
    print("\nThe long prompts without their first request (a warm-up prompt sent again: a prefix-cache hit on both):\n")
    print("| workload | mean TTFT vLLM / pdserve ms | ratio | mean E2EL vLLM / pdserve ms | ratio |\n|---|---|---|---|---|")
    for w in ("8192x16_c1", "32768x16_c1"):
        (vt, ve), (pt, pe) = (_misses(load(f"{base}/sbs/{n}_single_{w}.json")) for n in ("vllm", "pdserve"))
        print(f"| {w} | {vt:.1f} / {pt:.1f} | {pt / vt:.3f} | {ve:.1f} / {pe:.1f} | {pe / ve:.3f} |")


def session21() -> None:
    """Session 21 (H200s): the library prefill fed leaner; o/down/qkv split over K with float32 parts; the one-pass
    sampling kernel, alone and in the decode loops at temperature 1; the side by side."""
    base = "lease_s21"
    lr = load(f"{base}/s21a/library_row.json")["results"]
    print("One long prefill row through cuDNN on the engine's real pool layout (s21a, machine 1, "
          "`benchmarks/attention/bench_library_row.py`: dummy Qwen3-8B's 32 x 128 query heads over 8 KV heads, bf16; "
          "before: torch's index_select over the layer's strided view and zero-filled copies of every call's inputs; "
          "now: the Triton gather, no zero fill of rows an input covers, one query copy for both calls), us:\n")
    print("| prefix + new | gather before | gather now (GB/s) | row before (TFLOP/s) | row now (TFLOP/s) | the two calls "
          "alone (TFLOP/s) | outputs equal |\n|---|---|---|---|---|---|---|")
    for r in lr:
        g0 = f"{r['gather_old_us']:.1f}" if r["ctx"] else "-"
        g1 = f"{r['gather_us']:.1f} ({r['gather_GBps']:,.0f})" if r["ctx"] else "-"
        print(f"| {r['ctx']} + {r['new']} | {g0} | {g1} | {r['row_old_us']:.1f} ({r['row_old_tflops']:.0f}) | "
              f"{r['row_us']:.1f} ({r['row_tflops']:.0f}) | {r['calls_us']:.1f} ({r['calls_tflops']:.0f}) | "
              f"{'yes' if r['max_abs_diff'] == 0 else r['max_abs_diff']} |")
    big = [r for r in lr if r["ctx"] >= 8192]
    gx = [r["gather_old_us"] / r["gather_us"] for r in big]
    ct = [r["calls_tflops"] for r in big]
    print(f"\nThe gather is {min(gx):.1f}-{max(gx):.1f}x faster at 8k-24k prefixes, but the row is the two cuDNN calls "
          f"({min(ct):.0f}-{max(ct):.0f} TFLOP/s there) plus the merge: what feeding them cost was a few percent of it, "
          "within the calls' spread between runs (the 16k row was slower after, the 24k one faster).")
    st = load(f"{base}/s21a/steps.json")
    c = st["ceilings"]
    print(f"\nThe 32k prompt's four 8192-token chunks as engine steps (same machine, `bench_steps.py`, eager; floor = "
          f"the step's FLOPs at the bf16 matmul rate of the same run, {c['bf16_matmul_tflops']:.0f} TFLOP/s):\n")
    print("| step | ms | of floor |\n|---|---|---|")
    for r in st["results"]:
        print(f"| {r['case']} | {r['step_ms_median']:.2f} | {r['fraction_of_floor']:.0%} |")
    print(f"\nGPU tests of the library path (s21a): {_pytest_verdict(f'{base}/s21a/gpu_tests.txt')} (the whole file, "
          "its CPU-only interpreter tests among them: they hand CPU tensors to Triton on a CUDA host; the stage now "
          "runs `-m gpu`; s21c_tests below has the file's GPU tests passing).\n")
    d = load(f"{base}/s21a/gemm_split.json")
    c = d["ceilings"]
    print("Projections split over K with float32 partial sums (s21a, `bench_gemm_rows.py --split-k 2,3,4 --parts-dtype "
          f"fp32`; ceilings: HBM copy {c['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} "
          "TFLOP/s), us; `parts` leaves the sum to a later kernel (the next add + norm could take it):\n")
    print("| projection | rows | cuBLAS | split 2 parts | split 3 parts | split 4 parts |\n|---|---|---|---|---|---|")
    rows: dict = {}
    for r in d["results"]:
        key = (f"{r['shape']} {r['n']}x{r['k']}", r["rows"])
        row = rows.setdefault(key, {})
        if r.get("variant"):
            row[r["split_k"]] = r["us_bmm_only"]
            row["mm"] = r["us_mm"]
    for (name, m), row in rows.items():
        print(f"| {name} | {m} | {row['mm']:.2f} | " + " | ".join(
            f"{row[k]:.2f}" if k in row else "-" for k in (2, 3, 4)) + " |")
    print("\nThe one-pass sampling kernel (`pdserve.ops.sampling`) against the torch path, the sampler alone "
          "(`bench_sampler.py`: `sample_async` on Qwen3's 151,936-token vocabulary, bf16 logits; do_bench medians, "
          "host work included), us:\n")
    print("| run | rows | requests | torch | kernel | torch / kernel |\n|---|---|---|---|---|---|")
    for run, what in (("s21b", "s21b (machine 2: a program a row)"), ("s21c_tests_first", "s21c (machine 3: split "
                                                                                           "rows)"),
                      ("s21c_tests", "s21c (machine 4: the code as submitted)")):
        for r in load(f"{base}/{run}/sampler.json")["results"]:
            print(f"| {what} | {r['rows']} | {r['kind']} | {r['torch_us']:.1f} | {r['kernel_us']:.1f} | "
                  f"{r['torch_us'] / r['kernel_us']:.2f} |")
    print("\nAll-greedy batches keep torch's argmax (both columns the same path). One row's times are mostly the "
          "host's (pinned copies, two launches) and varied between machines.\n")
    for run, what in (("s21b", "s21b, machine 2, a program a row"), ("s21c_loops", "s21c, machine 4, the code as "
                                                                                   "submitted")):
        names = ("kernel1", "torch1", "kernel2", "torch2") if run == "s21b" else ("kernel1", "torch1", "torch2",
                                                                                  "kernel2")
        print(f"The steady decode loops at temperature 1 (every request samples; {what}; `bench_steps.py --loop "
              "256x1024,1x8192 --loop-temperature 1.0`, the kernel and `--sampler torch` in the order shown; async "
              "scheduling; floor = weights + KV at the HBM rate):\n")
        _ab_steps([(v, load(f"{base}/{run}/loop_{v}.json")) for v in names])
        print()
    print(f"GPU tests (s21c_tests, machine 4): sampling kernel {_pytest_verdict(f'{base}/s21c_tests/gpu_tests.txt')}; "
          f"warm-up burst and library prefill (-m gpu) {_pytest_verdict(f'{base}/s21c_tests/gpu_tests_warmup.txt')}. "
          "At the code before (s21c_tests_first, machine 3) the burst test failed: "
          f"{_pytest_verdict(f'{base}/s21c_tests_first/gpu_tests_warmup.txt')} (the pick kernel compiled per split "
          "count; now one tile and the split counts unspecialized).\n")
    print("Side by side with vLLM 0.22 (sbs/, machine 4 after s21c, `lease_1gpu.sh sbs`: vLLM, then pdserve, on the one "
          "H200; dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both, which sends no "
          "temperature: both servers sample at 1.0; kernels pdserve compiled while serving: "
          f"{_compiles(f'{base}/sbs/pdserve.log.gz')}):\n")
    _sbs_table(f"{base}/sbs")
    for w in ("8192x16_c1", "32768x16_c1"):
        _sbs_chunks(f"{base}/sbs", w)
    print("\nvLLM's stream sends its first tokens in one chunk, so its TTFT holds some decode steps and its TPOT is "
          "below any decode step; the median gap between chunks is the decode pace (pdserve's lower at both lengths). "
          "The long prompts without their first request (a warm-up prompt sent again: a prefix-cache hit on both):\n")
    print("| workload | mean TTFT vLLM / pdserve ms | ratio | mean E2EL vLLM / pdserve ms | ratio |\n|---|---|---|---|---|")
    for w in ("8192x16_c1", "32768x16_c1"):
        (vt, ve), (pt, pe) = (_misses(load(f"{base}/sbs/{n}_single_{w}.json")) for n in ("vllm", "pdserve"))
        print(f"| {w} | {vt:.1f} / {pt:.1f} | {pt / vt:.3f} | {ve:.1f} / {pe:.1f} | {pe / ve:.3f} |")


def session20() -> None:
    """The session-20 lease: one 2xH200 machine, then the 2-GPU kind was no longer lent (benchmarks/lease_s20)."""

    base = "lease_s20"
    print("GPU tests on 2xH200 (`lease_2xh200.sh tp_tests`, three files at once):\n")
    for name in ("test_kv_vmm", "test_pd_tp_gpu", "test_tp_gpu"):
        print(f"- `{name}`: {_pytest_verdict(f'{base}/tp_tests/gpu_tests_{name}.txt')}")
    print("\n1P1D through the router (`lease_2xh200.sh verify_pd`: `benchmarks/router/pd_handover.py`, "
          "`pdserve serve --prefill 1 --decode 1`, dummy Qwen3-8B, 8 requests a length, 6 for the isolated and fp8 "
          "runs), beside session 4's run of the same script:\n")
    print("| run | prompt tokens | handover p50 ms (s4) | order path p50 ms | first token out p50 ms | TTFT router p50 ms "
          "| TTFT prefill alone p50 ms | router - alone ms (s4) |\n|---|---|---|---|---|---|---|---|")
    for label, f in PD_RUNS:
        d = load(f"{base}/verify_pd/{f}.json")
        old = load(f"lease_s4/verify_pd/verify_pd/{f}.json")["results"]
        for n, r in d["results"].items():
            h, tr, ta = r["handover_s"]["p50"], r["ttft_router_s"]["p50"], r["ttft_prefill_alone_s"]["p50"]
            o = old.get(n)
            oh = f" ({o['handover_s']['p50'] * 1e3:.2f})" if o else ""
            od = f" ({(o['ttft_router_s']['p50'] - o['ttft_prefill_alone_s']['p50']) * 1e3:+.1f})" if o else ""
            print(f"| {label} | {n} | {h * 1e3:.2f}{oh} | {r['order_path_s']['p50'] * 1e3:.2f} | "
                  f"{r['first_token_out_s']['p50'] * 1e3:.2f} | {tr * 1e3:.1f} | {ta * 1e3:.1f} | "
                  f"{(tr - ta) * 1e3:+.1f}{od} |")
    bf = load(f"{base}/verify_pd/pd_handover.json")["results"]["8192"]["handover_s"]["p50"]
    f8 = load(f"{base}/verify_pd/pd_handover_fp8.json")["results"]["8192"]["handover_s"]["p50"]
    print(f"\nfp8 KV handover at 8k: {f8 * 1e3:.2f} ms against bf16's {bf * 1e3:.2f} ms ({100 * f8 / bf:.0f} %; "
          "issue 11 asks at most 60 %).")
    print("\ncuda_ipc rows of the transfer table (8192 tokens of Qwen3-8B KV, 512 random 16-token blocks, peer-copy "
          "ceiling of the same run):\n")
    print("| run | op | median ms | GB/s | ceiling GB/s | of ceiling |\n|---|---|---|---|---|---|")
    for name in ("cuda_ipc", "cuda_ipc_isolated_vmm"):
        res = load(f"{base}/verify_pd/transfer/{name}.json")["results"]
        for op in ("write", "read"):
            x = res[op]
            print(f"| {name} | {op} | {x['median_ms']:.2f} | {x['GBps']:.1f} | {x['ceiling_GBps']:.1f} | "
                  f"{100 * x['fraction_of_ceiling']:.0f} % |")
    ms = lambda r, k: "-" if not r.get(k) else f"{r[k]['p50'] * 1e3:.2f}"  # noqa: E731
    print("\nThen only one-GPU kinds were lent. 1P1D on one H200 (`lease_1gpu.sh s20_pd_share`, again as "
          "`s20_pd_share2`: `--allow-gpu-sharing`, prefill and decode instances on cuda:0, cuda_ipc between them, "
          "8000 KV blocks each, dummy Qwen3-8B, 6 requests a length), whole-block pushes (the default over cuda_ipc) "
          "against `--kv-layerwise on`, p50 ms:\n")
    print("| run | KV | push | prompt tokens | prefill | handover | TTFT router | TTFT prefill alone | router - alone |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for run in ("s20_pd_share", "s20_pd_share2"):
        for kv in ("auto", "fp8"):
            for arm in ("whole", "layerwise"):
                d = load(f"{base}/{run}/pd_{kv}_{arm}.json")
                for n, r in d["results"].items():
                    tr, ta = r["ttft_router_s"]["p50"], r["ttft_prefill_alone_s"]["p50"]
                    print(f"| {run} | {'bf16' if kv == 'auto' else kv} | {arm} | {n} | {ms(r, 'prefill_s')} | "
                          f"{ms(r, 'handover_s')} | {tr * 1e3:.1f} | {ta * 1e3:.1f} | {(tr - ta) * 1e3:+.1f} |")
    print("\nThe handover in phases (`lease_1gpu.sh s20_phases`, the whole-block arm on one H200; new in pd_timings: "
          "prefill done -> the prefill rank began the push -> the decode rank took the notification -> admitted), "
          "p50 ms:\n")
    print("| KV | prompt tokens | handover | push began | push landed | admitted | push_s (prefill side) | order path | "
          "first token out |\n|---|---|---|---|---|---|---|---|---|")
    for kv in ("auto", "fp8"):
        for n, r in load(f"{base}/s20_phases/phases_{kv}.json")["results"].items():
            print(f"| {'bf16' if kv == 'auto' else kv} | {n} | {ms(r, 'handover_s')} | {ms(r, 'push_start_s')} | "
                  f"{ms(r, 'push_landed_s')} | {ms(r, 'admit_s')} | {ms(r, 'push_s')} | {ms(r, 'order_path_s')} | "
                  f"{ms(r, 'first_token_out_s')} |")
    ic = load("router/results_cpu/intake_costs.json")
    lens = list(ic["results_ms"])
    print(f"\nOne pass over a prompt's token ids, each alone (`benchmarks/router/intake_costs.py`, best of {ic['reps']}, "
          f"the {ic['cpus']}-core development VM), ms:\n")
    print("| pass | " + " | ".join(f"{n} tokens" for n in lens) + " |\n|---|" + "---|" * len(lens))
    for k in ic["results_ms"][lens[0]]:
        print(f"| {k} | " + " | ".join(f"{ic['results_ms'][n][k]:.2f}" for n in lens) + " |")
    print(f"\nGPU tests `tests/kv/test_kv_cuda.py` on one H200 (s20_pd_share2): "
          f"{_pytest_verdict(f'{base}/s20_pd_share2/gpu_tests_kv_cuda.txt')}")


def session19() -> None:
    """Session 19 (H200s): what fusing the small kernels could save (ablation), split-K products, the norm and
    the activation folded into one-row products, the KV write folded into the rotary kernel, the side by side."""
    base = "lease_s19"
    print("What the small kernels cost (s19a, machine 1, `bench_steps.py --ablate`: the layers' RMS norms, SiLU*mul or "
          "the KV write skipped, outputs wrong; in that order with the unablated model first and last):\n")
    arms = [(v, load(f"{base}/s19a/steps_{v}.json")) for v in ("none", "all", "norm", "act", "kv_write", "none2")]
    _ab_steps(arms)
    step = [next(r["step_ms_median"] for r in d["results"] if r["case"] == "decode:256x1024") for _, d in arms]
    loop = [next(lp["step_ms"] for lp in d["loops"] if lp["async"] and lp["case"] == "loop:256x1024") for _, d in arms]
    print(f"\nThe batch-256 step alone (a zero KV pool, the same for every arm) took {min(step):.2f}-{max(step):.2f} ms "
          "across the arms. The loops write what the model computes into the pool and feed it to the products: with the "
          "KV write skipped the loop reads a pool of zeros, with the norms skipped the activations grow without bound. "
          f"Their batch-256 times ({min(loop):.2f}-{max(loop):.2f} ms) come with those data, so they are not what "
          "fusing the kernels would give; the batch-1 loop, whose time is the weights' reads, is the measure of the "
          "kernels themselves.\n")
    d = load(f"{base}/s19a/gemm_splitk.json")
    c = d["ceilings"]
    print("Products split over K in one strided-batched GEMM (`bench_gemm_rows.py --split-k`, same machine; views of x "
          "and W, no copies; the parts summed by a separate kernel, or left for a later kernel to add; ceilings: HBM "
          f"copy {c['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s):\n")
    print("| projection | rows | cuBLAS us | split 2, without the sum us | split 2, with the sum us |\n|---|---|---|---|---|")
    for r in d["results"]:
        if r.get("variant") and r["split_k"] == 2:
            print(f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['us_mm']:.2f} | {r['us_bmm_only']:.2f} | "
                  f"{r['us']:.2f} |")
    print("\nThe norm folded into the one-row q/k/v and gate_up products and SiLU*mul into the down projection (s19b, "
          "machine 2, code 74197f2: every program summed the row's squares before streaming its weights), on and off "
          f"alternating; GPU tests: {_gpu_tests(f'{base}/s19b/gpu_tests.txt')}:\n")
    _ab_steps([(v, load(f"{base}/s19b/steps_{v}.json")) for v in ("on1", "off1", "on2", "off2")])
    print("\nThe norm's squares summed in the product's own pass (s19c, machine 3, code 45a3d61): both folds, neither, "
          f"the norms only, the activation only; GPU tests: {_gpu_tests(f'{base}/s19c/gpu_tests.txt')}:\n")
    _ab_steps([(v, load(f"{base}/s19c/steps_{v}.json")) for v in ("all1", "none1", "norm", "act", "all2", "none2")])
    print("\nEvery program of a folded product re-reads the row (with its residual and the norm's weight) from L2; "
          "gate_up's one-row tile has 6,144 programs. The norm's fold was taken out; the activation's stays. "
          f"The activation alone folded (s19d, machine 4, the engine as submitted; GPU tests: "
          f"{_gpu_tests(f'{base}/s19d/gpu_tests.txt')}):\n")
    _ab_steps([(v, load(f"{base}/s19d/steps_{v}.json")) for v in ("on1", "off1", "on2", "off2", "on3", "off3")])
    print("\nThe same at the session's final engine code (s19f, machine 7: the activation's math then shared by its "
          f"kernel and the folded product; GPU tests: {_gpu_tests(f'{base}/s19f/gpu_tests.txt')}):\n")
    _ab_steps([(v, load(f"{base}/s19f/steps_{v}.json")) for v in ("on1", "off1", "on2", "off2")])
    print("\nThe KV write folded into the QK-norm + rotary kernel (s19e, machine 5, code ea7eeda, then reverted: "
          f"no faster; GPU tests: {_gpu_tests(f'{base}/s19e/gpu_tests.txt')}):\n")
    _ab_steps([(v, load(f"{base}/s19e/steps_{v}.json")) for v in ("on1", "off1", "on2", "off2")])
    for folder, what in (("sbs", "the default workloads"), ("sbs_long", "the two long-prompt workloads again, 8 "
                                                                        "prompts of 32k")):
        print(f"\nSide by side with vLLM 0.22 ({folder}/, machine 6, `lease_1gpu.sh sbs`, {what}: vLLM, then pdserve, "
              "on the one H200; dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both; "
              f"kernels pdserve compiled while serving: {_compiles(f'{base}/{folder}/pdserve.log.gz')}):\n")
        _sbs_table(f"{base}/{folder}")
        for w in ("8192x16_c1", "32768x16_c1"):
            _sbs_chunks(f"{base}/{folder}", w)


def session18() -> None:
    """Session 18 (H200s): a Triton tile GEMM against cuBLAS at 32..1024 rows; the two clients at a Poisson load
    with the same prompts and arrival times, trust_env off and on; the client's send path on a scripted server; the
    warm-up's many-program split variant."""
    base = "lease_s18"
    d = load(f"{base}/s18a/tile_linear.json.gz")
    c = d["ceilings"]
    print(f"A Triton tile GEMM (one output tile per program, the whole of K) against cuBLAS (s18a, machine 1, "
          f"`bench_tile_linear.py`, 31 tiles; graphs over weight copies larger than L2; same run's ceilings: HBM copy "
          f"{c['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s), the best tile per "
          "shape at 64, 256 and 1024 rows:\n")
    print("| model | projection | rows | floor us | cuBLAS us (of floor) | best tile us (of floor) | tile / cuBLAS |"
          "\n|---|---|---|---|---|---|---|")
    res = d["results"]
    for r in res:
        if r["impl"] != "cublas" or r["rows"] not in (64, 256, 1024):
            continue
        tiles = [t for t in res if t["model"] == r["model"] and t["shape"] == r["shape"] and t["rows"] == r["rows"]
                 and t["impl"] != "cublas" and "us" in t]
        b = min(tiles, key=lambda t: t["us"])
        print(f"| {r['model']} | {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['floor_us']:.1f} | "
              f"{r['us']:.1f} ({r['of_floor']:.0%}) | {b['us']:.1f} ({b['of_floor']:.0%}) | {b['us'] / r['us']:.2f} |")
    won = [k for k, v in d["table"].items() if not k.startswith("_") and v["kind"] != "cublas"]
    print(f"\nThe table it wrote names a tile for {len(won)} of {sum(1 for k in d['table'] if not k.startswith('_'))} "
          f"(shape, rows) entries ({', '.join(won)}); the engine keeps cuBLAS. Steps with that table and without "
          "(order new, old, new, old; the loop through `EngineCore.step`, async):\n")
    runs = [(v, load(f"{base}/s18a/steps_{v}.json")) for v in ("new1", "old1", "new2", "old2")]
    _ab_steps(runs)
    g = {b: {(r["shape"], r["rows"]): r for r in load(f"{base}/s18c/gemm_rows_{b}.json")["results"]}
         for b in ("cublas", "cublaslt")}
    print("\ncuBLASLt (`torch.backends.cuda.preferred_blas_library`) against torch's default cuBLAS on the same "
          "projections (s18c, machine 5, `bench_gemm_rows.py --blas`):\n")
    print("| projection | rows | cuBLAS us (of floor) | cuBLASLt us (of floor) |\n|---|---|---|---|")
    for (shape, rows), r in g["cublas"].items():
        if rows in (256, 512):
            lt = g["cublaslt"][(shape, rows)]
            print(f"| {shape} | {rows} | {r['us']:.1f} ({r['of_floor']:.0%}) | {lt['us']:.1f} ({lt['of_floor']:.0%}) |")
    runs = [(v, load(f"{base}/s18c/steps_{v}.json")) for v in ("cublas1", "cublaslt1", "cublas2", "cublaslt2")]
    print()
    _ab_steps(runs)
    cmp = _compare_module()
    run = "{srv}_single_1024x256_c0_rate16"
    print("\nThe two clients back to back on each server, 1024 in / 256 out, 320 prompts at 16 Poisson requests/s, "
          "both servers without prefix caching and every run with seed 0 (the same prompts and arrival times; "
          "`SAME_SEED=1`, side_by_side.sh). Ratios are pdserve's client / vLLM's, of the means over the rounds:\n")
    print("| pdserve's client | server | rounds | output tok/s | mean TTFT | mean TPOT | vLLM's client's mean TTFT by "
          "round, ms | pdserve's client's, ms |\n|---|---|---|---|---|---|---|---|")
    for label, folder, srv in (("trust_env off (machine 2)", f"{base}/sbs_poisson", "vllm"),
                               ("trust_env off (machine 2)", f"{base}/sbs_poisson", "pdserve"),
                               ("trust_env on, the new default (machine 3)", f"{base}/sbs_poisson_trustenv/vllm_server",
                                "vllm"),
                               ("trust_env on, the new default (machine 3)",
                                f"{base}/sbs_poisson_trustenv/pdserve_server", "pdserve")):
        rows = [r for r in cmp.client_rounds(B / folder) if r["run"] == run.format(srv=srv)]
        m = rows[0]["metrics"]
        print(f"| {label} | {srv} | {rows[0]['rounds']} | {m['output_throughput']['ratio_of_means']:.3f} | "
              f"{m['mean_ttft_ms']['ratio_of_means']:.3f} | {m['mean_tpot_ms']['ratio_of_means']:.3f} | "
              f"{', '.join(f'{x:.1f}' for x in m['mean_ttft_ms']['vllm_client'])} | "
              f"{', '.join(f'{x:.1f}' for x in m['mean_ttft_ms']['pdserve_client'])} |")
    print("\nThe same at 1024/1024, 512 prompts, concurrency 256, on vLLM's server (machine 6; trust_env on in both "
          "clients, the same prompts every run, no prefix caching):\n")
    _client_rounds_on_vllm(f"{base}/sbs_c256_clients", "pdserve's")
    print("\nRequests paired by index (trust_env off, machine 2): the clients' send times and each request's TTFT "
          "difference (pdserve's client - vLLM's):\n")
    print("| server | round | median \\|start difference\\| ms | TTFT difference median ms | mean ms |\n|---|---|---|---|---|")
    for srv in ("vllm", "pdserve"):
        for k, ds, med, mean in _paired_ttft(f"{base}/sbs_poisson", run.format(srv=srv), 2):
            print(f"| {srv} | {k} | {ds:.2f} | {med:.2f} | {mean:.2f} |")
    cp = load(f"{base}/client_poisson/summary.json")
    su = cp["setup"]
    print(f"\nThe send path on a scripted server (`client_intake.py --request-rate {su['request_rate']:g}`, this 2-core "
          f"CPU machine: {su['num_prompts']} prompts, first token {su['ttft_s'] * 1e3:.0f} ms after the request "
          f"arrives, then one every {su['itl_s'] * 1e3:.0f} ms; arrival = when the server's handler started, on the "
          "clients' clock):\n")
    print("| round | client | arrival - send, mean ms | p90 ms | client TTFT mean ms | TTFT - (first chunk sent - send) "
          "mean ms |\n|---|---|---|---|---|---|")
    for r in cp["runs"]:
        a = r["arrival_minus_start_ms"]
        print(f"| {r['round']} | {r['client']} | {a['mean']:.1f} | {a['p90']:.1f} | "
              f"{r['wave_client_ttft_ms']['mean']:.1f} | {r['wave_ttft_minus_truth_ms']['mean']:.2f} |")
    print("\nvllm and pd-asyncio-trustenv have aiohttp's trust_env on; vllm-notrustenv and pd-asyncio off.")
    with open(B / base / "s18b/gpu_tests.txt") as f:
        tail = [x for x in f.read().splitlines() if "passed" in x or "failed" in x]
    print(f"\nThe warm-up's new mixed step (s18b, machine 4): GPU tests of the decode kernel and the warm-up: "
          f"{tail[-1].strip() if tail else 'no summary line'}.", end=" ")
    log = gzip.decompress((B / base / "s18b/server.log.gz").read_bytes()).decode()
    n = log.count("compiled a kernel while serving")
    print(f"A server then served two runs of the Poisson load above (pdserve's client) and compiled {n} kernels "
          "while serving; the two pdserve servers of the runs above (machines 2 and 3) had each compiled one (the decode "
          "kernel's many-program tile with several splits, in a mixed step):\n")
    print("| run | output tok/s | mean TTFT ms | mean TPOT ms |\n|---|---|---|---|")
    for k in (1, 2):
        x = load(f"{base}/s18b/poisson_r{k}.json")
        print(f"| {k} | {x['output_throughput']:.1f} | {x['mean_ttft_ms']:.1f} | {x['mean_tpot_ms']:.2f} |")


def session17() -> None:
    """Session 17 (one H200 at a time, three machines): where a batch-256 decode step goes, the steady decode loop
    measured right, the decode kernel's many-program tile, the greedy argmax on bf16 logits, the side by side."""
    base = "lease_s17"
    prof = load(f"{base}/s17a/profile.json")
    print("Where a batch-256 decode step and a mixed step go (s17a, machine 1, `bench_steps.py --profile`, CUDA graphs; "
          "each step run and waited for, so the GPU idles while the host prepares the next):\n")
    for p in prof["profiles"]:
        g = p["graphs"] if "graphs" in p else p
        print(f"{p['case']}: {g['kernels_per_step']:.0f} kernels, {g['gpu_us_per_step'] / 1e3:.2f} ms of kernels a step; "
              f"GPU busy {g['gpu']['busy_us_per_step'] / 1e3:.2f} ms, idle {g['gpu']['idle_us_per_step'] / 1e3:.2f} ms\n")
        print("| kernels | a step | us a step |\n|---|---|---|")
        for name, c, us in _kernel_groups(g)[:9]:
            print(f"| {name} | {c:.0f} | {us:,.0f} |")
        print()
    gr = load(f"{base}/s17a/gemm_rows.json")
    c = gr["ceilings"]
    print(f"cuBLAS on Qwen3-8B's projections (s17a, `bench_gemm_rows.py`, graphs over weight copies larger than L2; same "
          f"run's ceilings: HBM copy {c['hbm_copy_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s; "
          "floor = the larger of FLOPs at the matmul rate and the weight at the copy rate):\n")
    print("| projection | rows | us | TFLOP/s | of floor |\n|---|---|---|---|---|")
    for r in gr["results"]:
        if r["rows"] in (256, 768):
            print(f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['us']:.1f} | {r['tflops']:.0f} | "
                  f"{r['of_floor']:.0%} |")
    b = load(f"{base}/s17b/steps.json")
    lp = [x for x in b["loops"] if x["case"] == "loop:256x1024" and "profile" in x][0]
    print(f"\nThe steady decode loop as session 16 measured it (s17b, machine 2): loop:256x1024 took {lp['step_ms']:.2f} ms "
          f"a step with {lp['profile']['gpu_us_per_step'] / 1e3:.2f} ms of kernels, less than the same step alone; it "
          f"ran {lp['outputs_per_step']:.1f} outputs a step, not 256: the first prompts started decoding while the "
          "last prefilled and finished early. The loop now gives every request enough tokens, counts its rows and "
          "context before each step, and takes its floor from them. The step alone on a pool of random values "
          "(`--fill-kv`) against zeros:\n")
    zero = {r["case"]: r for r in b["results"]}
    fill = {r["case"]: r for r in load(f"{base}/s17b/steps_fill.json")["results"]}
    print("| step | zero pool ms | random pool ms |\n|---|---|---|")
    for k in fill:
        print(f"| {k} | {zero[k]['step_ms_median']:.2f} | {fill[k]['step_ms_median']:.2f} |")
    print("\nThe decode kernel's many-program tile (64 keys, 3 stages, from 4 waves of programs) against the table's "
          "128-key tile, with the greedy argmax on bf16 logits in both (s17c, machine 3, order new, old, new, old; "
          "the loops through `EngineCore.step` with async scheduling, their floor at the rows and context counted "
          "before each step):\n")
    runs = [(v, load(f"{base}/s17c/steps_{v}.json")) for v in ("new1", "old1", "new2", "old2")]
    print("| step | floor ms | " + " | ".join(f"{v} ms (of floor)" for v, _ in runs) + " |\n|---|---|"
          + "---|" * len(runs))
    for i, r0 in enumerate(runs[0][1]["results"]):
        print(f"| {r0['case']} | {r0['floor_ms']:.2f} | " + " | ".join(
            f"{d['results'][i]['step_ms_median']:.2f} ({d['results'][i]['fraction_of_floor']:.0%})" for _, d in runs)
            + " |")
    for i, l0 in enumerate(runs[0][1]["loops"]):
        if not l0["async"]:
            continue
        print(f"| {l0['case']} steady, async ({l0['rows_per_step']:.0f} rows at {l0['mean_context']:.0f}) | "
              f"{l0['floor_ms']:.2f} | " + " | ".join(
                  f"{d['loops'][i]['step_ms']:.2f} ({d['loops'][i]['fraction_of_floor']:.0%})" for _, d in runs) + " |")
    with open(B / base / "s17c/gpu_tests.txt") as f:
        dots = f.read().count(".")
    print(f"\nGPU tests in s17c (test_attention_decode, test_warmup, test_cuda_graphs, test_async_gpu): {dots} passed "
          "before the stage's 230 s limit cut the run (37 decode attention tests, the warm-up burst that compiles "
          "nothing with up to 80 decode rows, 6 of 7 graph tests); no failure before it.\n")
    with open(B / base / "s17e/gpu_tests.txt") as f:
        groups = [ln.strip() for ln in f if " passed" in ln or " failed" in ln]
    print("The session's GPU tests at its final engine code (s17e, an H100: no H200 could be started then; "
          "test_attention_decode + test_warmup, test_cuda_graphs + test_async_gpu, test_vs_transformers + "
          "test_fused_engine, test_memory_profile + test_library_prefill): " + "; ".join(groups) + ".\n")
    print("Side by side with vLLM 0.22 (machine 3 after s17c, `lease_1gpu.sh sbs`: vLLM, then pdserve, on the one H200; "
          "dummy Qwen3-8B bf16, --gpu-memory-utilization 0.9; vLLM's `bench serve` on both):\n")
    _sbs_table(f"{base}/sbs")
    for n in ("vllm", "pdserve"):
        d = load(f"{base}/sbs/{n}_single_8192x16_c1.json")
        chunks, gap = _chunk_stats(d)
        print(f"- 8192x16 {n}: TPOT mean {d['mean_tpot_ms']:.2f} ms, median {d['median_tpot_ms']:.2f}; "
              f"{chunks:.1f} chunks a request for 16 tokens; median gap between chunks {gap:.2f} "
              f"ms; mean E2EL {d['mean_e2el_ms']:.1f} ms")
    lp = load(f"{base}/s17d/loop.json")["loops"][-1]
    print(f"\nThe steady loop at batch 256 under the profiler (s17d, machine 5, code 2f06dfe): {lp['step_ms']:.2f} ms a "
          f"step at {lp['rows_per_step']:.0f} rows, {lp['profile']['gpu_us_per_step'] / 1e3:.2f} ms of kernels, GPU idle "
          f"{lp['gpu']['idle_us_per_step'] / 1e3:.2f} ms a step; the same loop unprofiled "
          + ", ".join(f"{x['step_ms']:.2f} ms ({x['fraction_of_floor']:.0%} of {x['floor_ms']:.2f})"
                      for x in load(f"{base}/s17d/loop.json")["loops"] if x["async"] and "profile" not in x)
          + ". Its kernels:\n")
    print("| kernels | a step | us a step |\n|---|---|---|")
    for name, c, us in _kernel_groups(lp["profile"])[:8]:
        print(f"| {name} | {c:.0f} | {us:,.0f} |")
    print("\nThe two clients on vLLM's server (sbs_clients, machine 5 after s17d; rounds alternating, pdserve's client "
          "with `--trust-env` as vLLM's session sets it):\n")
    _client_rounds_on_vllm(f"{base}/sbs_clients", "pdserve's (--trust-env)")
    ci = load(f"{base}/client_intake/summary.json")
    print(f"\nThe clients' intake on this 2-core CPU machine (`client_intake.py`, a scripted server in its own process: "
          f"first token {ci['setup']['ttft_s'] * 1e3:.0f} ms after arrival; {ci['setup']['num_prompts']} prompts of "
          f"{ci['setup']['input_len']} tokens at concurrency {ci['setup']['max_concurrency']}; the first wave's "
          "server arrival minus the client's recorded start, and the TTFT the client reports for that wave):\n")
    print("| round | client | arrival - start mean ms | client TTFT mean ms |\n|---|---|---|---|")
    for r in ci["runs"]:
        print(f"| {r['round']} | {r['client']} | {r['arrival_minus_start_ms']['mean']:.1f} | "
              f"{r['wave_client_ttft_ms']['mean']:.1f} |")


def session16() -> None:
    """Session 16 (one H200 at a time, four machines): cuDNN's fused attention for long prefill rows, the KV sizing
    test at 0.6, the side by side with vLLM at 8k/32k."""
    base = "lease_s16"
    print("Prefill attention of one row on the 32k prompt's chunks (`probe_sdpa_backends.py`, s16a: before the library "
          "path; Hq x D = 32 x 128 over 8 KV heads, bf16; triton.testing.do_bench medians; TFLOP/s of the causal "
          "pairs):\n")
    print("| prefix + new | Triton us | TFLOP/s | cuDNN (one call, lower-right mask or causal) us | cuDNN split + merge us "
          "| torch flash us | gather us |\n|---|---|---|---|---|---|---|")
    for r in load(f"{base}/s16a/sdpa.json")["rows"] + [x for x in load(f"{base}/s16b_first/s16b/sdpa.json")["rows"]]:
        tf = r["flops"] / r["triton_us"] / 1e6
        print(f"| {r['ctx']} + {r['new']} | {r['triton_us']:.1f} | {tf:.0f} | {r.get('cudnn_us', float('nan')):.1f} | "
              f"{_fmt(r.get('cudnn_split_us'))} | {r.get('flash_us', float('nan')):.1f} | {r['gather_us']:.1f} |")
    print("\n(The s16b rows at 4096 decided MIN_CHUNK; s16a's 0 + 512 Triton time includes a first-call effect.)\n")
    fc = load(f"{base}/s16b/sdpa.json")
    print("First calls through the backend on shapes new to the process (s16b, with the padded shapes: queries to "
          "multiples of 256, the unmasked prefix to multiples of 1024), ms of three calls in a row:\n")
    print("| prefix + new | path | ms |\n|---|---|---|")
    for r in fc["first_calls"]:
        print(f"| {r['ctx']} + {r['new']} | {'cuDNN' if r['library'] else 'Triton'} | "
              f"{', '.join(f'{x:.2f}' for x in r['ms'])} |")
    print("\nThe 32k prompt's 8192-token chunks as engine steps (bench_steps, dummy Qwen3-8B, eager; floor = the "
          "step's FLOPs at the matmul rate measured in the same run), with the library (auto) and without (none):\n")
    print("| machine | step | auto ms | of floor | none ms | of floor |\n|---|---|---|---|---|---|")
    for m, rel in (("3", "s16b_first/s16b"), ("4", "s16b")):
        a, n = load(f"{base}/{rel}/steps_auto.json"), load(f"{base}/{rel}/steps_none.json")
        tot = [0.0, 0.0]
        for ra, rn in zip(a["results"], n["results"]):
            tot[0] += ra["step_ms_median"]
            tot[1] += rn["step_ms_median"]
            print(f"| {m} | {ra['case']} | {ra['step_ms_median']:.1f} | {ra['fraction_of_floor']:.0%} | "
                  f"{rn['step_ms_median']:.1f} | {rn['fraction_of_floor']:.0%} |")
        print(f"| {m} | all four | {tot[0]:.1f} | | {tot[1]:.1f} | |")
    print("\nGPU tests:\n")
    for name, rel in (("s15 (session 14's code): test_memory_profile", "s15/gpu_tests.txt"),
                      ("s16a: test_memory_profile with the step's peaks in the message", "s16a/gpu_tests.txt"),
                      ("s16b machine 3: test_library_prefill, test_memory_profile (probe from an emptied cache), "
                       "test_attention_backend", "s16b_first/s16b/gpu_tests.txt"),
                      ("s16b machine 4: the same, padded shapes", "s16b/gpu_tests.txt")):
        with open(B / base / rel) as f:
            lines = f.read().splitlines()
        summary = [ln.strip() for ln in lines if " passed" in ln or " failed" in ln][-1]
        over = [ln.split("AssertionError: ")[1] for ln in lines if "AssertionError: " in ln and "GiB in use" in ln]
        print(f"- {name}: {summary}" + (f" ({'; '.join(over)})" if over else ""))
    with open(B / base / "s16c/startup.txt") as f:
        startup = f.read().strip()
    warm = _srv_line(f"{base}/s16c/server.log.gz", "warm-up:").split("engine: ")[1]
    print(f"\nStart-up builds the common shapes (s16c, machine 5, code 9bc86e8): \"{warm}\"; {startup}. A fresh "
          "server's first long prompts, each length twice with different random tokens (first_long_requests.py), "
          "TTFT ms:\n")
    print("| tokens | first | second |\n|---|---|---|")
    for r in load(f"{base}/s16c/first.json")["rows"]:
        print(f"| {r['tokens']} | {r['ttft_ms'][0]:.1f} | {r['ttft_ms'][1]:.1f} |")
    print("\nSide by side with vLLM 0.22 (`lease_1gpu.sh sbs`: vLLM, then pdserve, on one H200; dummy Qwen3-8B bf16, "
          "--gpu-memory-utilization 0.9; vLLM's `bench serve` on both). `sbs`: machine 4 after s16b, code 1518761; "
          "`sbs2`: machine 5 after s16c, code 9bc86e8 (start-up warm-up of the shapes); `sbs3`: machine 6 after s16d, code "
          "021b040 (the session's end):\n")
    print("| run | workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean "
          "TPOT vLLM / pdserve ms | ratio |\n|---|---|---|---|---|---|---|---|---|")
    for run in ("sbs", "sbs2", "sbs3"):
        c = load(f"{base}/{run}/comparison.json")
        for w in sorted(c["workloads"], key=lambda w: w["workload"]):
            if w.get("vllm") is None or w.get("pdserve") is None:
                continue
            print(f"| {run} | {w['workload']} | {_sbs_cells(w['vllm'], w['pdserve'])}")
    print("\nPer-request TTFT (ms; the first requests repeat the client's warm-up prompt and hit the prefix cache):\n")
    for run, w in (("sbs", "32768x16_c1"), ("sbs2", "32768x16_c1"), ("sbs3", "32768x16_c1"), ("sbs", "8192x16_c1"),
                   ("sbs3", "8192x16_c1")):
        for n in ("vllm", "pdserve"):
            t = [round(x * 1000) for x in load(f"{base}/{run}/{n}_single_{w}.json")["ttfts"]]
            miss = [x for x in t if x > max(t) / 2]
            print(f"- {run} {w} {n}: {t}; mean of the misses {sum(miss) / len(miss):.1f}")
    print()
    for run in ("sbs", "sbs2", "sbs3"):
        srv = {n: load(f"{base}/{run}/{n}_single_server.json") for n in ("vllm", "pdserve")}
        v, p = srv["vllm"], srv["pdserve"]
        print(f"- {run}: KV tokens vLLM {v['kv_tokens']:,}, pdserve {p['kv_tokens']:,} "
              f"({p['kv_tokens'] / v['kv_tokens']:.4f}x); start-up (launch to first completion): vLLM "
              f"{v['startup_s']:.1f} s, pdserve {p['startup_s']:.1f} s")
    print("\nRMS norms folded into the one-row skinny projection (s16d, machine 6, code 46a2e08, reverted in the next "
          "commit): dummy Qwen3-8B, batch 1, bench_steps in the order fused, unfused, unfused, fused; ms a step:\n")
    print("| run | decode 1x8192 (graph) | decode 1x1024 (graph) | async loop 1x8192 |\n|---|---|---|---|")
    for v in ("fused", "unfused", "unfused2", "fused2"):
        d = load(f"{base}/s16d/steps_{v}.json")
        res = {r["case"]: r["step_ms_median"] for r in d["results"]}
        loop = [x["step_ms"] for x in d["loops"] if x["async"]][0]
        print(f"| {v} | {res['decode:1x8192']:.2f} | {res['decode:1x1024']:.2f} | {loop:.2f} |")
    itl = {}
    for n in ("vllm", "pdserve"):
        d = load(f"{base}/sbs/{n}_single_8192x16_c1.json")
        ms = [(sum(x[1:12]) / 11 * 1000, t * 1000) for x, t in zip(d["itls"], d["ttfts"])]
        top = max(t for _, t in ms)
        hit = [m for m, t in ms if t < top / 2]
        miss = [m for m, t in ms if t >= top / 2]
        itl[n] = (sum(hit) / len(hit), sum(miss) / len(miss))
    print(f"\nAt 8192/16 the gaps between tokens 2-12 were longer after a prefill that ran than after a prefix-cache "
          f"hit, on both servers (sbs): vLLM {itl['vllm'][0]:.2f} vs {itl['vllm'][1]:.2f} ms, pdserve "
          f"{itl['pdserve'][0]:.2f} vs {itl['pdserve'][1]:.2f} ms (hit vs prefilled); the same held in sessions "
          "12 and 14.")


def session14() -> None:
    """Session 14 (one H200 at a time, three machines): KV sizing's free cached blocks found and removed, the side
    by side with vLLM at 8k/32k one at a time (16 and 256 output tokens) and 1024/1024 c256, the two clients."""
    base = "lease_s14"
    print("Where KV sizing's free cached blocks were (`probe_memory.py`: PyTorch allocator history with Python stacks "
          "through the KV sizing probe, dummy Qwen3-8B, --gpu-memory-utilization 0.9; a segment goes back to the device "
          "only when none of its blocks is live):\n")
    print("| run | segments | GiB free beside live blocks | of it beside blocks made before the probe | pool blocks |\n"
          "|---|---|---|---|---|")
    for name, rel in (("before (s14b, default allocator)", "s14b/probe_default.json"),
                      ("before, expandable segments (s14b)", "s14b/probe_expandable.json"),
                      ("merged projections allocate only their stack (s14c)", "s14c/probe.json")):
        d = load(f"{base}/{rel}")
        a = d["after_probe"]
        pre = sum(r["free_bytes"] for r in a["pinned"] if not any(b["frames"] for b in r["live"]))
        print(f"| {name} | {a['segments']} | {a['free_in_pinned_bytes'] / 2**30:.3f} | {pre / 2**30:.3f} | "
              f"{d['num_blocks']:,} |")
    d = load(f"{base}/s14b/probe_default.json")["after_probe"]
    shapes: dict = {}
    for r in d["pinned"]:
        k = (r["segment_bytes"] >> 20, r["free_bytes"] >> 20, tuple(sorted(b["bytes"] >> 20 for b in r["live"])))
        shapes[k] = shapes.get(k, 0) + 1
    (seg, free, live), n = max(shapes.items(), key=lambda kv: kv[1])
    print(f"\nBefore: {n} segments of {seg} MiB each held {free} MiB free beside live blocks of {' and '.join(map(str, live))}"
          " MiB made before the probe (the weights: a QKV stack and an o_proj of Qwen3-8B); the holes were the q/k/v and "
          "gate/up parts that each layer allocated, stacked, then freed. Now the parts are made on the meta device and "
          "only the stack is allocated.\n")
    for name, rel in (("s14 (session 13's code)", "s14/server.log.gz"), ("s14b (claim_blas_workspace reverted)",
                                                                       "s14b/server.log.gz"),
                      ("s14c (merged stacks only)", "s14c/server.log.gz")):
        line = _srv_line(f"{base}/{rel}", "GiB in use before the pool").split("KV sizing: ")[1]
        print(f"- {name}: \"{line}\"")
    print("\nGPU tests in those calls:\n")
    for name, rel in (("s14: test_memory_profile (session 13's code, claim_blas_workspace)", "s14/gpu_tests.txt"),
                      ("s14b: test_memory_profile (claim_blas_workspace reverted)", "s14b/gpu_tests_default.txt"),
                      ("s14b, expandable segments: test_memory_profile, test_cuda_graphs, test_warmup",
                       "s14b/gpu_tests_expandable.txt"),
                      ("s14c: test_memory_profile, test_vs_transformers (merged stacks only, reserved peak)",
                       "s14c/gpu_tests.txt")):
        with open(B / base / rel) as f:
            lines = f.read().splitlines()
        summary = [ln.strip() for ln in lines if " passed" in ln or " failed" in ln][-1]
        failed = [ln.split("::")[-1].split(" ")[0] for ln in lines if ln.startswith("FAILED")]
        over = [ln.split("AssertionError: ")[1] for ln in lines if "AssertionError: " in ln and "GiB in use" in ln]
        print(f"- {name}: {summary}; failed: {', '.join(failed) or 'none'}" + (f" ({'; '.join(over)})" if over else ""))
    print("\nSide by side with vLLM 0.22 (`lease_1gpu.sh sbs`: vLLM, then pdserve, on one H200; dummy Qwen3-8B bf16, "
          "--gpu-memory-utilization 0.9; vLLM's `bench serve` on both). One machine per column group:\n")
    print("| run | workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | ratio | mean TPOT "
          "vLLM / pdserve ms | ratio |\n|---|---|---|---|---|---|---|---|---|")
    kv = []
    for run in ("sbs_long", "sbs_c256", "sbs_long2", "sbs_kv"):
        c = load(f"{base}/{run}/comparison.json")
        for w in sorted(c["workloads"], key=lambda w: w["workload"]):
            if w.get("vllm") is None or w.get("pdserve") is None:
                continue
            print(f"| {run} | {w['workload']} | {_sbs_cells(w['vllm'], w['pdserve'], 2)}")
        srv = {n: load(f"{base}/{run}/{n}_single_server.json") for n in ("vllm", "pdserve")}
        kv.append((run, srv))
    print("\n| run | vLLM KV tokens | pdserve KV tokens | ratio | start-up vLLM / pdserve s |\n|---|---|---|---|---|")
    for run, srv in kv:
        v, p = srv["vllm"], srv["pdserve"]
        print(f"| {run} | {v['kv_tokens']:,} | {p['kv_tokens']:,} | "
              f"{p['kv_tokens'] / v['kv_tokens']:.4f} | {v['startup_s']:.1f} / {p['startup_s']:.1f} |")
    print(f"\nStream chunks per request (sbs_kv): vLLM {_chunk_count(f'{base}/sbs_kv/vllm_single_8192x16_c1.json')} at "
          f"8192/16 and {_chunk_count(f'{base}/sbs_kv/vllm_single_32768x16_c1.json')} at 32768/16; pdserve "
          f"{_chunk_count(f'{base}/sbs_kv/pdserve_single_8192x16_c1.json')} and "
          f"{_chunk_count(f'{base}/sbs_kv/pdserve_single_32768x16_c1.json')} (one a token, then the closing chunk). A chunk "
          "of several tokens moves their decode time from TPOT into TTFT, so at 16 output tokens vLLM's TPOT is "
          "smaller than its tokens' pace (at 32768/16 below any 32k decode step) and its TTFT larger; with 256 output "
          "tokens the TPOT is the steady pace.")
    print("\nThe two clients on vLLM's server (`sbs_clients`: c1 and c16, round 1 only, as round 2 repeated round 1's "
          "prompts and was served from the prefix cache; `sbs_clients_c256`: each round its own --seed):\n")
    print("| run | workload | round | metric | vLLM's client | pdserve's client | pdserve's / vLLM's |\n"
          "|---|---|---|---|---|---|---|")
    for run, w, rounds in (("sbs_clients", "8192x16_c1", [""]), ("sbs_clients", "1024x256_c16", [""]),
                           ("sbs_clients_c256", "1024x1024_c256", ["", "_r2"])):
        for i, r in enumerate(rounds):
            a = load(f"{base}/{run}/vllm_single_{w}{r}.json")
            b = load(f"{base}/{run}/vllm_single_{w}{r}_pdclient.json")
            for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
                print(f"| {run} | {w} | {i + 1} | {k} | {a[k]:,.2f} | {b[k]:,.2f} | {b[k] / a[k]:.3f} |")
    lg = load(f"{base}/loopgap/loop_new.json")
    lp = next(x for x in lg["loops"] if x.get("gpu"))
    g = lp["gpu"]
    step = next(r for r in lg["results"] if r["case"] == "decode:1x8192")
    print(f"\nThe async decode loop at 1x8192 under the profiler (`loopgap`, same machine as sbs_long): "
          f"{lp['step_ms']:.2f} ms a step, GPU busy {g['busy_us_per_step'] / 1e3:.2f} ms and idle "
          f"{g['idle_us_per_step'] / 1e3:.3f} ms a step; the loop is GPU-bound (the graph step through runner.execute, "
          f"which waits for each step, took {step['step_ms_median']:.2f} ms against a floor of {step['floor_ms']:.2f} ms).")


def session13() -> None:
    """The session-13 call (one H200, the only one the session's device time allowed): the decode split rule's new
    default, the warm-up's one-split short steps, and where the KV sizing's 0.77 GiB outside tensors lives."""
    base = "lease_s13/s13"
    with open(B / base / "gpu_tests.txt") as f:
        lines = f.read().splitlines()
    tests = [ln.strip() for ln in lines if " passed" in ln][-1]
    failed = [ln.split("::")[-1].split(" ")[0] for ln in lines if ln.startswith("FAILED")]
    print(f"GPU tests (`lease_1gpu.sh s13`: the warm-up, the KV pool's sizing, decode attention) with the split rule's "
          f"new defaults, and with the KV pool then not counting PyTorch's free cached blocks as used: {tests}; failed: "
          f"{', '.join(failed) or 'none'}. The burst after the warm-up compiled nothing.\n")
    with gzip.open(B / base / "server.log.gz", "rt") as f:
        log = f.read()
    sizing = next(ln for ln in log.splitlines() if "GiB in use before the pool" in ln).split("KV sizing: ")[1]
    blocks = int(log.split(" KV blocks of ")[0].rsplit(" ", 1)[1])
    per = int(log.split(" KV blocks of ")[1].split(" ")[0])
    with open(B / base / "startup.txt") as f:
        startup = f.read().strip()
    print(f"One `pdserve serve` as the side by side starts it (dummy Qwen3-8B, --gpu-memory-utilization 0.9, "
          f"--max-model-len 40960), with that accounting: \"{sizing}\"; {blocks:,} blocks of {per} tokens = "
          f"{blocks * per:,} KV tokens; {startup}. That accounting is not kept (the failed test above).\n")
    print("Decode steps of dummy Qwen3-8B (`bench_steps.py`, CUDA graphs, max-model-len 40960), the earlier split rule "
          "(programs for 2 waves, at least 256 keys a split) and the new default (4 waves, 64 keys), run in the order "
          "old, new, new, old in one call:\n")
    _steps_table([(v, f"{base}/steps_{k}.json") for v, k in (("old 1", "old1"), ("new 1", "new1"), ("new 2", "new2"),
                                                            ("old 2", "old2"))],
                 ["decode:1x1024", "decode:1x8192", "decode:1x32768", "decode:4x8192", "decode:16x1024"])
    runs = [load(f"{base}/steps_{k}.json") for k in ("old1", "new1", "new2", "old2")]
    loop = " / ".join(f"{next(lp for lp in d['loops'] if lp['async'])['step_ms']:.2f}" for d in runs)
    step = " / ".join(f"{next(r for r in d['results'] if r['case'] == 'decode:1x8192')['step_ms_median']:.2f}"
                      for d in runs)
    print(f"\nThe async decode loop at batch 1 and 8k (the engine's serving path) did not move ({loop} ms a step, "
          f"same order), while the same shape through `runner.execute` did ({step} ms); why the two differ was not "
          "examined in this call.")
    srv = load("lease_s12/sbs_long/pdserve_single_8192x16_c1.json")
    steady = [sorted(col)[len(col) // 2] * 1e3 for col in zip(*(x[1:-1] for x in srv["itls"]))]
    loop = next(lp for lp in load("lease_s12/pdl/steps_early.json")["loops"] if lp["case"] == "loop:1x8192" and lp["async"])
    print(f"\nA lead, from session 12's files (two machines, so not a measurement): served 8192/16 one at a time "
          f"(`lease_s12/sbs_long`), pdserve's median gap between tokens position by position, the first and last left "
          f"out, was {min(steady):.2f}-{max(steady):.2f} ms; the in-process async loop at 1x8192 (`lease_s12/pdl`, "
          f"PDL early) took {loop['step_ms']:.2f} ms a step.")


def session12() -> None:
    """The session-12 leases (one H200): the skinny linear kernel for few-row decode steps, programmatic dependent
    launch, the side by side with vLLM after both, and one code path run four times (a merge A/B that was not one)."""
    base = "lease_s12"
    print("Few-row linear products on one H200 (`bench_linear.py --sweep`: CUDA graphs over copies of each weight "
          "larger than L2 together; bf16). The fastest skinny tile per shape against cuBLAS (`F.linear`) at one and "
          "eight rows:\n")
    print("| model | projection | N x K | rows | cuBLAS us | skinny us | GB/s | speed-up | tile |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for m in ("qwen3-8b", "qwen3-30b-a3b"):
        d = load(f"{base}/skinny/linear_{m}.json")
        for rows in (1, 8):
            shapes = dict.fromkeys((r["shape"], r["n"], r["k"]) for r in d["results"])
            for name, n, k in shapes:
                mine = [r for r in d["results"] if r["shape"] == name and r["rows"] == rows and "us" in r]
                cub = next(r for r in mine if r["impl"] == "cublas")
                best = min((r for r in mine if r["impl"].startswith("skinny")), key=lambda r: r["us"])
                c = best["config"]
                print(f"| {m} | {name} | {n} x {k} | {rows} | {cub['us']:.2f} | {best['us']:.2f} | {best['gbps']:,.0f} | "
                      f"{cub['us'] / best['us']:.2f}x | {c['kind']} {c['block_n']}x{c['block_k']}, {c['num_warps']} warps,"
                      f" {c['num_stages']} stages |")
    c = load(f"{base}/skinny/linear_qwen3-8b.json")["ceilings"]
    print(f"\nSame run's HBM copy rate: {c['hbm_copy_gbps']:,.0f} GB/s (bytes read + written). A weight read alone "
          "goes faster than a copy (lm_head above); the reduction meant as a read ceiling (`hbm_read_gbps`, "
          f"{c['hbm_read_gbps']:,.0f} GB/s) was slower than the GEMV kernels, so it is not quoted as one. Where a "
          "shape's best multi-row tile lost to cuBLAS, the shipped table says `cublas` for it.")
    print("\nDummy Qwen3-8B decode steps (`bench_steps.py`, CUDA graphs), the skinny kernel against cuBLAS, same call "
          "(`skinny_steps/`, before PDL):\n")
    _steps_table([("skinny", f"{base}/skinny_steps/steps_skinny.json"),
                  ("cuBLAS", f"{base}/skinny_steps/steps_no-skinny.json")],
                 ["decode:1x1024", "decode:1x8192", "decode:2x1024", "decode:4x1024", "decode:8x1024", "decode:16x1024"])
    print("\nProgrammatic dependent launch (`pdl/`, one call, skinny kernel on unless said): the next kernel may "
          "launch at a kernel's start (`early`, now the default), after its wait (`late`), or not before it ends "
          "(`off`):\n")
    _steps_table([(m, f"{base}/pdl/steps_{m.replace(' ', '')}.json") for m in ("early", "late", "off")]
                 + [("off, cuBLAS", f"{base}/pdl/steps_offnoskinny.json")],
                 ["decode:1x1024", "decode:1x8192", "decode:2x1024", "decode:4x1024", "decode:8x1024",
                  "decode:16x1024", "decode:256x1024"])
    with open(B / base / "pdl" / "gpu_tests.txt") as f:
        tests = [ln.strip() for ln in f if " passed" in ln][-1]
    print(f"\nGPU tests on that machine: {tests} (the same requests give bit-identical logits in all three modes).")
    print("\nThe first version let every kernel launch the next at its start, the tensor-core skinny tile (2..16 "
          "rows, up to 160 KiB of shared memory) included (`pdl_first/`, one call):\n")
    _steps_table([("PDL at start, all kernels", f"{base}/pdl_first/steps_pdlskinny.json"),
                  ("off", f"{base}/pdl_first/steps_nopdlskinny.json")],
                 ["decode:1x1024", "decode:1x8192", "decode:4x1024", "decode:8x1024", "decode:256x1024"])
    print("\nSide by side with vLLM 0.22 on the one GPU, dummy Qwen3-8B bf16, vLLM's client (`sbs_long/`, then "
          f"`sbs_c256/` on the same machine; kernels compiled while serving: "
          f"{_compiles(f'{base}/sbs_long/pdserve.log.gz')}, {_compiles(f'{base}/sbs_c256/pdserve.log.gz')}):\n")
    _side_by_side(load(f"{base}/sbs_long/comparison.json"))
    print()
    _side_by_side(load(f"{base}/sbs_c256/comparison.json"))
    print("\n| workload | server | mean TTFT ms | mean TTFT after the first request ms | mean TPOT ms | median TPOT ms |"
          "\n|---|---|---|---|---|---|")
    for w in ("8192x16_c1", "32768x16_c1"):
        for srv in ("vllm", "pdserve"):
            r = load(f"{base}/sbs_long/{srv}_single_{w}.json")
            after = 1e3 * sum(r["ttfts"][1:]) / (len(r["ttfts"]) - 1)
            print(f"| {w} | {srv} | {r['mean_ttft_ms']:.1f} | {after:.1f} | {r['mean_tpot_ms']:.2f} | "
                  f"{r['median_tpot_ms']:.2f} |")
    print("\nThe decode kernel's split rule on whole steps (`splits/`, one call, dummy Qwen3-8B, max-model-len 40960): "
          "today's (programs for 2 waves, at least 256 keys a split) against 4 waves and 64 keys, bf16 twice "
          "alternating, then an fp8 pool once each. The GPU tests with the second as the default then failed the "
          "warm-up test (a mixed-step specialization the warm-up did not compile), so it is not the default:\n")
    _steps_table([(f"{v} {r}", f"{base}/splits/bf16_{k}_{r}.json") for r in (1, 2)
                  for v, k in (("2 waves, 256 keys", "base"), ("4 waves, 64 keys", "w4k64"))],
                 ["decode:1x1024", "decode:1x8192", "decode:1x32768", "decode:4x8192", "decode:8x1024",
                  "decode:16x1024", "decode:256x1024"])
    print()
    _steps_table([("fp8, 2 waves, 256 keys", f"{base}/splits/fp8_base.json"),
                  ("fp8, 4 waves, 64 keys", f"{base}/splits/fp8_w4k64.json")],
                 ["decode:1x1024", "decode:1x8192", "decode:1x32768", "decode:4x8192"])
    print("\nOne code path (main's: PDL early, the merge kernel) four times in one call (`merge_ab/`). The run was "
          "meant as an A/B of the splits merged inside the decode kernel (branch `wip-fused-merge`), but the engine's "
          "runner builds its attention metadata without the counters that path needs, so both arms ran the merge "
          "kernel: the spread below is run-to-run noise of identical code:\n")
    _steps_table([("run 1", f"{base}/merge_ab/steps_fused-merge.json"),
                  ("run 2", f"{base}/merge_ab/steps_no-fused-merge.json"),
                  ("run 3", f"{base}/merge_ab/steps_fused-merge_2.json"),
                  ("run 4", f"{base}/merge_ab/steps_no-fused-merge_2.json")],
                 ["decode:1x1024", "decode:1x8192", "decode:4x1024", "decode:8x1024", "decode:16x1024",
                  "decode:256x1024", "mixed:256x1024+512"])


def session11() -> None:
    """The session-11 lease (one H200): prefill attention reading the step's new K/V from k/v (A/B in one lease),
    dummy Qwen3-30B-A3B with fp8 KV and dense Qwen3-8B one prompt at a time against vLLM, and the clients on vLLM's
    server with pdserve's on plain asyncio."""
    base = "lease_s11"
    print("Prefill attention (`bench_attention.py`, 32 query heads, d=128, one H200): the new tokens' K/V read from "
          "the step's k/v (`--new-kv`, now the default) vs every key from the pool (`--no-new-kv`, the kernel before), "
          "in one call:\n")
    print("| KV heads | pool | shape | from k/v us | TFLOP/s | from the pool us | TFLOP/s | speed-up |\n"
          "|---|---|---|---|---|---|---|---|")
    for hk in (4, 8):
        a = {(r["kv"], r["shape"]): r for r in load(f"{base}/newkv/attn_hk{hk}_new-kv.json")["prefill"]}
        b = {(r["kv"], r["shape"]): r for r in load(f"{base}/newkv/attn_hk{hk}_no-new-kv.json")["prefill"]}
        for key, r in a.items():
            o = b[key]
            print(f"| {hk} | {key[0]} | {key[1]} | {r['us']:.1f} | {r['tflops']:.1f} | {o['us']:.1f} | "
                  f"{o['tflops']:.1f} | {o['us'] / r['us']:.2f}x |")
    with open(B / base / "newkv" / "gpu_tests.txt") as f:
        tests = [ln.strip() for ln in f if " passed" in ln][-1]
    print(f"\nGPU tests of the prefill kernel, fp8 KV and the backend on the same machine: {tests}.")
    print("\nThe 8192-token prefill step (`bench_steps.py`, eager), both ways in one call:\n")
    print("| model | from k/v ms | from the pool ms | speed-up | floor ms | floor / measured (from k/v) |\n"
          "|---|---|---|---|---|---|")
    for m, name in (("qwen3-30b-a3b", "dummy Qwen3-30B-A3B, fp8 KV"), ("qwen3-8b", "dummy Qwen3-8B, bf16 KV")):
        n = {r["case"]: r for r in load(f"{base}/newkv_steps/{m}_prefill-new-kv.json")["results"]}["prefill:8192"]
        o = {r["case"]: r for r in load(f"{base}/newkv_steps/{m}_no-prefill-new-kv.json")["results"]}["prefill:8192"]
        print(f"| {name} | {n['step_ms_median']:.2f} | {o['step_ms_median']:.2f} | "
              f"{o['step_ms_median'] / n['step_ms_median']:.3f}x | {n['floor_ms']:.2f} | {n['fraction_of_floor']:.1%} |")
    print("\nSide by side, dummy Qwen3-30B-A3B with fp8 KV on both (`lease_1gpu.sh moe`, vLLM's client; vLLM with "
          f"`--attention-backend FLASH_ATTN`; kernels compiled while serving: {_compiles(f'{base}/moe/pdserve.log.gz')}):\n")
    _side_by_side(load(f"{base}/moe/comparison.json"))
    print("\nSide by side, dummy Qwen3-8B bf16, one prompt at a time (`lease_1gpu.sh sbs`, vLLM's client, "
          f"--save-detailed; kernels compiled while serving: {_compiles(f'{base}/sbs_long/pdserve.log.gz')}):\n")
    _side_by_side(load(f"{base}/sbs_long/comparison.json"))
    print("\n| workload | server | mean TTFT ms | mean TTFT after the first request ms | mean TPOT ms |\n|---|---|---|---|---|")
    for d, w in (("moe", "8192x16_c1"), ("sbs_long", "8192x16_c1"), ("sbs_long", "32768x16_c1")):
        for srv in ("vllm", "pdserve"):
            r = load(f"{base}/{d}/{srv}_single_{w}.json")
            after = 1e3 * sum(r["ttfts"][1:]) / (len(r["ttfts"]) - 1)
            print(f"| {'MoE fp8 ' if d == 'moe' else ''}{w} | {srv} | {r['mean_ttft_ms']:.1f} | {after:.1f} | "
                  f"{r['mean_tpot_ms']:.2f} |")
    print("\nThe first request of each one-at-a-time run is a prefix hit of the client's warm-up prompts.")
    _chunks32k(base)
    print("\nThe two clients on vLLM's server, rounds alternating, pdserve's client with uvloop blocked (plain "
          "asyncio, as vLLM's client runs):\n")
    _client_rounds_on_vllm(f"{base}/sbs_asyncio", "pdserve's (asyncio)")
    runs = load(f"{base}/client_intake/summary.json")["runs"] + load(f"{base}/client_intake/ablation/summary.json")["runs"]
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["client"], []).append(r["arrival_minus_start_ms"]["mean"])
    print("\nWhere vLLM's client loses the time (`benchmarks/vs_vllm/client_intake.py`, CPU, scripted server in its own "
          "process, 256 of 512 prompts of 1024 tokens at once, the same texts; mean of the first wave's server arrival "
          "minus the client's recorded start, ms, per run):\n")
    print("| client | arrival - start ms |\n|---|---|")
    for k, xs in by.items():
        print(f"| {k} | {', '.join(f'{x:.0f}' for x in xs)} |")
    print("\nThe two clients on vLLM's server again (a second machine), pdserve's client with `--trust-env` (vLLM's "
          "session setting):\n")
    _client_rounds_on_vllm(f"{base}/sbs_trustenv", "pdserve's (--trust-env)")


def _round_cells(m: dict) -> str:
    """One metric of compare.py's client_rounds: each client's value by round, the ratio of means, both drifts."""
    return (f"{', '.join(f'{x:.2f}' for x in m['vllm_client'])} | "
            f"{', '.join(f'{x:.2f}' for x in m['pdserve_client'])} | {m['ratio_of_means']:.3f} | "
            f"{100 * m['drift_vllm_client']:.1f} % / {100 * m['drift_pdserve_client']:.1f} %")


def _client_rounds_on_vllm(folder: str, pd_name: str) -> None:
    """Both clients in alternating rounds on vLLM's server at 1024/1024 c256 (DETAILED=1, SBS_ROUNDS=2): the
    client_rounds table of compare.py, then each run's TTFT by wave."""
    print("| metric | vLLM's client by round | pdserve's client by round | ratio of means | "
          "drift between a client's own rounds, vLLM's / pdserve's |\n|---|---|---|---|---|")
    for row in load(f"{folder}/comparison.json")["client_rounds"]:
        for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
            print(f"| {k} | {_round_cells(row['metrics'][k])} |")
    print("\n| round | client | mean TTFT ms | first wave ms | second wave ms | first wave's last first token s |"
          "\n|---|---|---|---|---|---|")
    for r in ("", "_r2"):
        for c, name in (("", "vLLM's"), ("_pdclient", pd_name)):
            m, w1, w2, last = _first_wave(f"{folder}/vllm_single_1024x1024_c256{r}{c}.json")
            print(f"| {2 if r else 1} | {name} | {m:.1f} | {w1:.1f} | {w2:.1f} | {last:.2f} |")


def _chunks32k(base: str) -> None:
    """The four 8k chunks of a 32k prompt against their floors, and the last chunk's prefill attention rate."""
    d = load(f"{base}/chunks32k/steps.json")
    c = d["ceilings"]
    print("\nThe four 8192-token chunks of a 32k prompt, dummy Qwen3-8B bf16 (`lease_1gpu.sh chunks32k`, `bench_steps.py "
          f"--prefill C+N`, eager; same run's bf16 matmul ceiling {c['bf16_matmul_tflops']:.0f} TFLOP/s):\n")
    print("| step | ms (median) | floor ms | floor / measured |\n|---|---|---|---|")
    for r in d["results"]:
        if r["case"].startswith("prefill"):
            print(f"| {r['case']} | {r['step_ms_median']:.2f} | {r['floor_ms']:.2f} | {r['fraction_of_floor']:.1%} |")
    prof = load(f"{base}/chunks32k/profile.json")["profiles"][0]["graphs"]
    pk = {t["name"]: t for t in prof["top"]}["_prefill_kernel"]
    cached, new = (int(x) for x in load(f"{base}/chunks32k/profile.json")["profiles"][0]["case"].split(":")[1].split("+"))
    flops = d["engine"]["attn_flops_per_pair"] * (new * cached + new * (new + 1) / 2)
    print(f"\nThe last chunk's kernels: {prof['gpu_us_per_step'] / 1e3:.1f} ms a step, prefill attention "
          f"{pk['us_per_step'] / 1e3:.1f} ms ({pk['share']:.1%}; {flops / (pk['us_per_step'] * 1e-6) / 1e12:.0f} TFLOP/s over "
          f"its {cached:,} pool keys and {new:,} new ones; whole prompts read from k/v reach 455-457 TFLOP/s above). The "
          f"four steps add up to {sum(r['step_ms_median'] for r in d['results'] if r['case'].startswith('prefill')):,.0f} ms, "
          "more than the served 32k TTFT above; the pool's prefix here holds uninitialised memory, and why the sum is "
          "higher was not examined.")


def session10() -> None:
    """The session-10 lease (one H200): the clients in alternating rounds on each server, KV capacity, the 8k
    prefill step without the MLP's join, fp8 products in prefill attention (measured, not adopted)."""
    base = "lease_s10"
    print("Side by side (`lease_1gpu.sh sbs`, one server a call: SBS_SERVERS=vllm, then pdserve on a fresh start; "
          "dummy Qwen3-8B bf16, 1024/1024, 512 prompts, concurrency 256; SBS_ROUNDS=2: vLLM's client, pdserve's, "
          "vLLM's, pdserve's; kernels compiled while serving: "
          f"{_compiles(f'{base}/sbs_pdserve/pdserve.log.gz')}):\n")
    print("| round | client | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | "
          "mean TPOT vLLM / pdserve ms |\n|---|---|---|---|---|---|---|")
    for r in ("", "_r2"):
        for c, name in (("", "vLLM's"), ("_pdclient", "pdserve's")):
            v = load(f"{base}/sbs_vllm/vllm_single_1024x1024_c256{r}{c}.json")
            p = load(f"{base}/sbs_pdserve/pdserve_single_1024x1024_c256{r}{c}.json")
            print(f"| {2 if r else 1} | {name} | {v['output_throughput']:.1f} | {p['output_throughput']:.1f} | "
                  f"{p['output_throughput'] / v['output_throughput']:.3f} | {v['mean_ttft_ms']:.1f} / "
                  f"{p['mean_ttft_ms']:.1f} | {v['mean_tpot_ms']:.2f} / {p['mean_tpot_ms']:.2f} |")
    sv = load(f"{base}/sbs_vllm/vllm_single_server.json")
    sp = load(f"{base}/sbs_pdserve/pdserve_single_server.json")
    _startup_kv(sv, sp, "{:.4f}")
    print("\nThe two clients on each server, rounds alternating (compare.py's client_rounds):\n")
    print("| server | metric | vLLM's client by round | pdserve's client by round | ratio of means | "
          "drift between a client's own rounds, vLLM's / pdserve's |\n|---|---|---|---|---|---|")
    for srv in ("vllm", "pdserve"):
        for row in load(f"{base}/sbs_{srv}/comparison.json")["client_rounds"]:
            for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
                print(f"| {srv} | {k} | {_round_cells(row['metrics'][k])} |")
    print("\nTTFT by wave (per-request start times and TTFTs: the first 256 requests sent, then the 256 sent as they "
          "finished):\n")
    print("| server | round | client | mean TTFT ms | first wave ms | second wave ms | first wave's last first token "
          "s |\n|---|---|---|---|---|---|---|")
    for srv in ("vllm", "pdserve"):
        for r in ("", "_r2"):
            for c, name in (("", "vLLM's"), ("_pdclient", "pdserve's")):
                m, w1, w2, last = _first_wave(f"{base}/sbs_{srv}/{srv}_single_1024x1024_c256{r}{c}.json")
                print(f"| {srv} | {2 if r else 1} | {name} | {m:.1f} | {w1:.1f} | {w2:.1f} | {last:.2f} |")
    st = {r["case"]: r for r in load(f"{base}/steps8k/steps.json")["results"]}
    c = load(f"{base}/steps8k/steps.json")["ceilings"]
    print(f"\nEngine steps against their floors (`lease_1gpu.sh steps8k`, dummy Qwen3-8B; same run's ceilings: HBM "
          f"copy {c['hbm_copy_gbps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s):\n")
    print("| step | ms (median) | floor ms | floor / measured |\n|---|---|---|---|")
    for k in ("prefill:8192", "decode:1x1024", "decode:256x1024"):
        r = st[k]
        print(f"| {k} | {r['step_ms_median']:.2f} | {r['floor_ms']:.2f} | {r['fraction_of_floor']:.1%} |")
    for name, rel in (("dummy Qwen3-8B", "steps8k/profile.json"), ("dummy Qwen3-30B-A3B, fp8 KV",
                                                                 "steps8k/moe_profile.json")):
        prof = load(f"{base}/{rel}")["profiles"][0]["graphs"]
        top = {t["name"]: t for t in prof["top"]}
        pk = top["_prefill_kernel"]
        cat = sum(t["us_per_step"] for t in prof["top"] if t["name"].startswith("void at::native::(anonymous "
                                                                                "namespace)::CatArray"))
        print(f"\n8192-token prefill step of the {name}: {int(prof['kernels_per_step'])} kernels, "
              f"{prof['gpu_us_per_step'] / 1e3:.1f} ms of kernel time; prefill attention {pk['us_per_step'] / 1e3:.1f} "
              f"ms ({pk['us_per_step'] / pk['count_per_step']:.0f} us a layer, {pk['us_per_step'] / prof['gpu_us_per_step']:.1%}); "
              f"torch.cat copies {cat / 1e3:.1f} ms.")
    print("\nPrefill attention on an e4m3 pool, 32 query and 4 KV heads (Qwen3-30B-A3B), `bench_attention.py`: K/V "
          "widened to bf16 in registers (the kernel as it is) vs queries and probabilities quantized to e4m3 with "
          "both products on fp8 tensor cores (an experiment, reverted):\n")
    print("| shape | widened us | TFLOP/s | fp8 products us | TFLOP/s |\n|---|---|---|---|---|")
    a0 = {r["shape"]: r for r in load(f"{base}/fp8attn/attn_hk4_fp8dot0.json")["prefill"]}
    a1 = {r["shape"]: r for r in load(f"{base}/fp8attn/attn_hk4_fp8dot1.json")["prefill"]}
    for sh in a0:
        print(f"| {sh} | {a0[sh]['us']:.1f} | {a0[sh]['tflops']:.1f} | {a1[sh]['us']:.1f} | {a1[sh]['tflops']:.1f} |")
    m0 = {r["case"]: r for r in load(f"{base}/fp8attn/moe_steps_fp8dot0.json")["results"]}
    m1 = {r["case"]: r for r in load(f"{base}/fp8attn/moe_steps_fp8dot1.json")["results"]}
    print(f"\nThe dummy Qwen3-30B-A3B's 8192-token prefill step (fp8 KV): {m0['prefill:8192']['step_ms_median']:.2f} ms "
          f"widened, {m1['prefill:8192']['step_ms_median']:.2f} ms with fp8 products.")
    with open(B / base / "fp8attn" / "gpu_tests.txt") as f:
        errs = [ln.strip().lstrip(".") for ln in f if "fp8 products: relative error" in ln]
    print("Accuracy against the float reference (tests/ops/test_attention_prefill.py on the H200): " + "; ".join(errs))


def faults() -> None:
    k = load("faults/results_cpu/kill_table.json")
    st = k["settings"]
    print(f"`{k['command']}` (commit {k['git_commit']}, {k['date'][:10]}, {k['machine']['cpus']} CPU cores shared "
          f"with other work): `pdserve serve --prefill 1 --decode 1` with the default model (Gemma 3 270M) on CPU, "
          f"instance flags `{' '.join(st['instance_args'])}`, router flags `{' '.join(st['router_args'])}` (every "
          f"request disaggregated); {st['concurrency']} clients send requests back to back (completions and chat, "
          f"streaming and not, {st['max_tokens']} tokens each, deadline {st['deadline_s']:.0f} s). Lost must be 0."
          + _loads(k["reps"]) + "\n")
    print("| kill | rep | sent | completed | clean errors | lost | recovery s | restarted instance healthy / "
          "serving s | pools whole (s after the load stopped) | processes left behind |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    names = {"decode": "decode instance", "prefill": "prefill instance", "router": "router (restarted at once)"}
    for r in k["reps"]:
        restart = "-" if r["scenario"] == "router" else \
            f"{_fmt(r['restart_healthy_s'])} / {_fmt(r['restart_serving_s'])}"
        whole = f"yes ({r['pools_whole_after_s']:.1f})" if r["pools_whole"] else "**no**"
        print(f"| {names[r['scenario']]} | {r['rep']} | {r['sent']} | {r['completed']} | {r['clean_errors']} | "
              f"{r['lost']} | {_fmt(r['recovery_s'])} | {restart} | {whole} | {len(r.get('left_behind', []))} |")
    print()
    for s, t in k["totals"].items():
        kinds: dict[str, int] = {}
        for r in k["reps"]:
            if r["scenario"] == s:
                for what, n in r["errors"].items():
                    kinds[what] = kinds.get(what, 0) + n
        print(f"- {names[s]}: {t['sent']} sent, {t['completed']} completed, {t['clean_errors']} clean errors "
              f"({', '.join(f'{n} {w}' for w, n in sorted(kinds.items(), key=lambda x: -x[1])) or 'none'}), "
              f"{t['lost']} lost; pools whole after every repetition: {'yes' if t['pools_whole'] else 'NO'}")


def _side_by_side(c: dict) -> None:
    """A side_by_side comparison (compare.py's JSON): the workload table, then each server pair's start-up and KV."""
    print("| workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | "
          "mean TPOT vLLM / pdserve ms |")
    print("|---|---|---|---|---|---|")
    for w in c["workloads"]:
        v, p = w["vllm"], w["pdserve"]
        print(f"| {w['workload']} | {_fmt(v['output_throughput'])} | {_fmt(p['output_throughput'])} | "
              f"{w['ratio']['output_throughput']:.2f} | {_fmt(v['mean_ttft_ms'])} / {_fmt(p['mean_ttft_ms'])} | "
              f"{v['mean_tpot_ms']:.2f} / {p['mean_tpot_ms']:.2f} |")
    for srv in c["servers"]:
        _startup_kv(srv["vllm"], srv["pdserve"])


def _startup_kv(v: dict, p: dict, ratio: str = "{:.3f}") -> None:
    """One server pair's start-up and KV capacity (side_by_side's <name>_server.json)."""
    print(f"\nStart-up (launch to first completion answered): vLLM {v['startup_s']:.1f} s, pdserve "
          f"{p['startup_s']:.1f} s. KV capacity at --gpu-memory-utilization 0.9: vLLM {v['kv_tokens']:,} tokens, "
          f"pdserve {p['kv_tokens']:,} tokens ({ratio.format(p['kv_tokens'] / v['kv_tokens'])}x).")


def _loads(reps: list[dict]) -> str:
    la = [r["loadavg_1m"] for r in reps if r.get("loadavg_1m") is not None]
    return f" Load average at the kills: {min(la):.1f} to {max(la):.1f}." if la else ""


def _fmt(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    return "inf" if x == float("inf") else f"{x:,.1f}"


if __name__ == "__main__":
    status()
    print()
    session43()
    print()
    session42()
    print()
    session41()
    print()
    session40()
    session39()
    print()
    session38()
    print()
    session37()
    print()
    session36()
    print()
    session35()
    print()
    session34()
    print()
    session33()
    print()
    session32()
    print()
    session31()
    print()
    session30()
    print()
    session29()
    print()
    session28()
    print()
    session27()
    print()
    session26()
    print()
    session25()
    print()
    session24()
    print()
    session23()
    print()
    session22()
    print()
    session21()
    print()
    session20()
    print()
    session19()
    print()
    session18()
    print()
    session17()
    print()
    session16()
    print()
    session14()
    print()
    session13()
    print()
    session12()
    print()
    session11()
    print()
    session10()
    print()
    session9()
    print()
    session8()
    print()
    session7()
    print()
    session5()
    print()
    session4()
    print()
    vs_vllm()
    print()
    kernels_s3()
    print()
    engine()
    transfer()
    handover()
    server()
    search()
    print()
    faults()

"""Does vLLM 0.22's benchmark client get a burst of requests to the server later than pdserve's client does?

Each client runs in its own process against a scripted fake OpenAI server (tests/bench/fake_server.py) in a
third process; the server records when every request's handler started (`arrival`) and when its first token
chunk left, on time.perf_counter (CLOCK_MONOTONIC on Linux, so comparable across processes). The clients record
each request's send time (`start`) and TTFT on the same clock. Requests are matched by their x-request-id
header (both clients send `<prefix><i>`; the initial test and warm-up requests carry none).

Clients:
  vllm       a replica of vLLM 0.22's `benchmark()` loop (vllm/benchmarks/serve.py) under plain asyncio.run,
             calling vLLM's own `async_request_openai_completions` loaded by path from the vLLM source
  pd-uvloop  `pdserve bench serve --no-trust-env` (pdserve.bench.cli.main) with uvloop importable
  pd-asyncio the same with sys.modules["uvloop"] = None, so it runs on plain asyncio

Both clients send the same 512 prompts of 1024 tokens (pdserve.bench.datasets.random_dataset, seed 0, with the
Qwen3-8B tokenizer); the server's dump carries a hash of every prompt so this is checked.

Ablations of the replica (one vLLM session setting changed; not run by default): vllm-notrustenv
(ClientSession(trust_env=False)), vllm-pdconnector (pdserve's TCPConnector(limit=0, ttl_dns_cache=300)), and
vllm-notrustenv-pdconnector (both); and pdserve's client with `--trust-env` (pd-asyncio-trustenv, on plain asyncio);
pick them with --clients.

Run (about 1.5 minutes for the 6 default runs on a 2-core machine; uvloop must be importable for pd-uvloop):
  python benchmarks/vs_vllm/client_intake.py --out benchmarks/lease_s11/client_intake

Poisson arrivals instead of a burst (--request-rate; both clients draw the same arrival times from seed 0), e.g. the
load of lease_s18's client rounds (1024 in, 256 out at 16 requests/s), with the fake server's TTFT and token gap near
what the H200 served:
  python benchmarks/vs_vllm/client_intake.py --request-rate 16 --num-prompts 320 --output-len 256 --ttft 0.06 \
    --itl 0.011 --max-concurrency 1000 --wave 320 --clients vllm,pd-asyncio --out benchmarks/lease_s18/client_poisson
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_ROOT = "/tmp/vllm_src"
DEFAULT_TOKENIZER = str(REPO / ".vllm-stage" / "model")
CLIENTS = ("vllm", "pd-uvloop", "pd-asyncio")
# pdserve's client with --trust-env (vLLM's session setting; not run by default)
PD_VARIANTS = ("pd-asyncio-trustenv",)
# ablations of the vLLM replica (not run by default): one session setting changed each
VLLM_VARIANTS = {"vllm": {}, "vllm-notrustenv": {"trust_env": False}, "vllm-pdconnector": {"pd_connector": True},
                 "vllm-notrustenv-pdconnector": {"trust_env": False, "pd_connector": True}}
ALL_CLIENTS = CLIENTS + tuple(v for v in VLLM_VARIANTS if v not in CLIENTS) + PD_VARIANTS
MODEL = "fake-model"


# --------------------------------------------------------------------------------------------------------
# the fake server, in its own process


def serve(args) -> int:
    spec = importlib.util.spec_from_file_location("fake_server", REPO / "tests" / "bench" / "fake_server.py")
    fs = importlib.util.module_from_spec(spec)
    sys.modules["fake_server"] = fs  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(fs)
    script = fs.Script(ttft_s=args.ttft, itl_s=args.itl)
    with fs.FakeServer(script) as srv:
        print(f"PORT {srv.port}", flush=True)
        for line in sys.stdin:  # "dump PATH" writes what the server saw; EOF stops it
            cmd, _, path = line.strip().partition(" ")
            if cmd != "dump":
                continue
            recs = []
            for r in list(srv.records):
                prompt = str(r.body.get("prompt", ""))
                recs.append({
                    "request_id": r.request_id, "arrival": r.arrival, "status": r.status,
                    "first_chunk": r.chunk_times[0] if r.chunk_times else None, "chunks": len(r.chunk_times),
                    "end": r.end, "prompt_sha1": hashlib.sha1(prompt.encode()).hexdigest()[:12],
                    "max_tokens": r.body.get("max_tokens"),
                })
            Path(path).write_text(json.dumps({"script": vars(script), "records": recs}))
            print("DUMPED", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------------
# client 1: vLLM 0.22's benchmark loop, replicated, with vLLM's own request function


def load_vllm_request_module(vllm_root: str):
    try:
        import regex  # noqa: F401
    except ImportError:  # the request file only needs `regex as re`; the stdlib's re does for what it uses
        stub = Path(tempfile.mkdtemp(prefix="regex_stub_"))
        (stub / "regex.py").write_text("from re import *\n")
        sys.path.insert(0, str(stub))
    path = Path(vllm_root) / "vllm" / "benchmarks" / "lib" / "endpoint_request_func.py"
    spec = importlib.util.spec_from_file_location("vllm_endpoint_request_func", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


async def vllm_get_request(input_requests, request_rate, burstiness=1.0):
    """vLLM 0.22's get_request without ramp-up (serve.py)."""
    import numpy as np

    total_requests = len(input_requests)
    delay_ts = []
    for _ in input_requests:
        if request_rate == float("inf"):
            delay_ts.append(0)
        elif burstiness == float("inf"):
            delay_ts.append(1.0 / request_rate)
        else:
            theta = 1.0 / (request_rate * burstiness)
            delay_ts.append(np.random.gamma(shape=burstiness, scale=theta))
    for i in range(1, len(delay_ts)):
        delay_ts[i] += delay_ts[i - 1]
    if delay_ts[-1] != 0:
        target_total_delay_s = total_requests / request_rate
        normalize_factor = target_total_delay_s / delay_ts[-1]
        delay_ts = [delay * normalize_factor for delay in delay_ts]
    start_ts = time.time()
    for request_index, request in enumerate(input_requests):
        if delay_ts[request_index] > 0:
            current_ts = time.time()
            sleep_interval_s = start_ts + delay_ts[request_index] - current_ts
            if sleep_interval_s > 0:
                await asyncio.sleep(sleep_interval_s)
        yield request, request_rate


async def vllm_benchmark(m, api_url, base_url, model_id, model_name, input_requests, num_warmups, max_concurrency,
                         ignore_eos, request_rate=float("inf"), burstiness=1.0, trust_env=True, pd_connector=False):
    """vLLM 0.22's benchmark() (serve.py ~608-870), generation task, no LoRA/profile/ramp-up, tqdm off.

    trust_env=False or pd_connector=True (pdserve's TCPConnector(limit=0, ttl_dns_cache=300)) are ablations.
    """
    import aiohttp

    request_func = m.ASYNC_REQUEST_FUNCS["vllm"]
    ssl_setting = "https://" in api_url
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300) if pd_connector else aiohttp.TCPConnector(
        limit=max_concurrency or 0,
        limit_per_host=max_concurrency or 0,
        ttl_dns_cache=300,
        use_dns_cache=True,
        keepalive_timeout=60,
        enable_cleanup_closed=True,
        force_close=False,
        ssl=ssl_setting,
    )
    session = aiohttp.ClientSession(connector=connector, trust_env=trust_env,
                                    timeout=aiohttp.ClientTimeout(total=6 * 60 * 60))
    first = input_requests[0]
    test_input = m.RequestFuncInput(model=model_id, model_name=model_name, prompt=first["prompt"], api_url=api_url,
                                    prompt_len=first["prompt_len"], output_len=first["output_len"], logprobs=None,
                                    multi_modal_content=None, ignore_eos=ignore_eos, extra_headers=None,
                                    extra_body={})
    # wait_for_endpoint: the endpoint is up, so its first try succeeds
    test_output = await request_func(request_func_input=test_input, session=session)
    if not test_output.success:
        raise ValueError(f"Initial test run failed: {test_output.error}")
    if num_warmups > 0:
        warmup_semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        warmup_tasks = []

        async def warmup_limited_request_func():
            async with warmup_semaphore:
                return await request_func(request_func_input=test_input, session=session, pbar=None)

        for _ in range(num_warmups):
            warmup_tasks.append(asyncio.create_task(warmup_limited_request_func()))
        _ = await asyncio.gather(*warmup_tasks)

    # fetch_spec_decode_metrics(base_url, session): a GET /metrics (404 here, so None)
    try:
        async with session.get(f"{base_url}/metrics") as response:
            if response.status == 200:
                await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass

    semaphore = asyncio.Semaphore(max_concurrency)

    async def limited_request_func(request_func_input, session, pbar):
        async with semaphore:
            return await request_func(request_func_input=request_func_input, session=session, pbar=pbar)

    benchmark_start_time = time.perf_counter()
    tasks: list[asyncio.Task] = []
    async for request, _rate in vllm_get_request(input_requests, request_rate, burstiness):
        request_func_input = m.RequestFuncInput(
            model=model_id, model_name=model_name, prompt=request["prompt"], api_url=api_url,
            prompt_len=request["prompt_len"], output_len=request["output_len"], logprobs=None,
            multi_modal_content=None, ignore_eos=ignore_eos, extra_headers=None, extra_body={},
            request_id=request["request_id"],
        )
        tasks.append(asyncio.create_task(limited_request_func(request_func_input=request_func_input,
                                                              session=session, pbar=None)))
    outputs = await asyncio.gather(*tasks)
    benchmark_duration = time.perf_counter() - benchmark_start_time
    await session.close()
    return benchmark_start_time, benchmark_duration, outputs


def run_vllm_client(args) -> int:
    from pdserve.bench.datasets import random_dataset
    from pdserve.bench.tokenizer import load_tokenizer

    m = load_vllm_request_module(args.vllm_root)
    tok = load_tokenizer(args.tokenizer)
    ds = random_dataset(tok, args.num_prompts, args.input_len, args.output_len, 0.0, 0, 0)
    reqs = [{"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "request_id": f"{args.prefix}{i}"} for i, r in enumerate(ds)]
    del ds, tok
    # main_async: freeze_gc_heap() right before benchmark()
    gc.collect(0), gc.collect(1), gc.collect(2)
    gc.freeze()
    import numpy as np

    np.random.seed(0)  # vLLM's main seeds numpy's global generator with --seed (0), which get_request draws from
    t0, dur, outputs = asyncio.run(vllm_benchmark(
        m, f"{args.base_url}/v1/completions", args.base_url, MODEL, None, reqs, args.num_warmups,
        args.max_concurrency, ignore_eos=True, request_rate=args.request_rate, **VLLM_VARIANTS[args.client]))
    out = {"client": args.client, "loop": "asyncio", "t0": t0, "duration": dur, "requests": [
        {"request_id": r["request_id"], "start": o.start_time, "ttft": o.ttft if o.success else None,
         "success": o.success, "error": o.error[-300:] if o.error else None}
        for r, o in zip(reqs, outputs)]}
    Path(args.client_out).write_text(json.dumps(out))
    return 0


# --------------------------------------------------------------------------------------------------------
# clients 2 and 3: pdserve's `bench serve`, with and without uvloop


def run_pdserve_client(args) -> int:
    if args.no_uvloop:
        sys.modules["uvloop"] = None  # `import uvloop` now raises ImportError: the CLI falls back to asyncio.run
    import pdserve.bench.runner as runner

    captured = {}
    orig = runner.run_load

    async def run_load(*a, **k):  # only to read the live results (absolute send times) after the run
        captured["loop"] = type(asyncio.get_running_loop()).__module__
        lr = await orig(*a, **k)
        captured["lr"] = lr
        return lr

    runner.run_load = run_load
    from pdserve.bench.cli import main

    argv = ["serve", "--backend", "vllm", "--base-url", args.base_url, "--model", MODEL,
            "--tokenizer", args.tokenizer, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--num-warmups", str(args.num_warmups),
            "--request-id-prefix", args.prefix, "--disable-tqdm", "--no-plots", "--seed", "0",
            "--request-rate", str(args.request_rate)]
    # trust_env explicit either way (pdserve's default turned on in session 18; these runs compare it on and off)
    argv.append("--trust-env" if args.client.endswith("-trustenv") else "--no-trust-env")
    rc = main(argv)
    lr = captured["lr"]
    out = {"client": args.client, "loop": captured["loop"], "t0": lr.t0,
           "duration": lr.duration, "rc": rc, "requests": [
               {"request_id": r.request_id, "start": r.start, "ttft": r.ttft if r.num_chunks else None,
                "success": r.success, "error": r.error or None} for r in lr.results]}
    Path(args.client_out).write_text(json.dumps(out))
    return rc


# --------------------------------------------------------------------------------------------------------
# analysis


def pct(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) if xs else None


def analyze(client: dict, server: dict, first_n: int) -> dict:
    by_id = {r["request_id"]: r for r in server["records"] if r["request_id"]}
    reqs = [r for r in client["requests"] if r["start"]]
    matched = [(c, by_id[c["request_id"]]) for c in reqs if c["request_id"] in by_id]
    matched.sort(key=lambda cs: cs[0]["start"])
    wave = matched[:first_n]
    s0 = wave[0][0]["start"]
    starts = [c["start"] for c, _ in wave]
    lag = [(s["arrival"] - c["start"]) * 1e3 for c, s in wave]
    arrivals = sorted(s["arrival"] for _, s in wave)
    ok = [(c, s) for c, s in wave if c["ttft"] is not None and s["first_chunk"] is not None]
    ttft_excess = [(c["ttft"] - (s["first_chunk"] - c["start"])) * 1e3 for c, s in ok]
    ttft_client = [c["ttft"] * 1e3 for c, _ in ok]
    ttft_truth = [(s["first_chunk"] - c["start"]) * 1e3 for c, s in ok]
    all_ok = [(c, s) for c, s in matched if c["ttft"] is not None and s["first_chunk"] is not None]
    c1, s1 = wave[0]
    return {
        "client": client["client"],
        "loop": client["loop"],
        "matched_by": "x-request-id",
        "num_client_requests": len(reqs),
        "num_matched": len(matched),
        "num_success": sum(1 for c in reqs if c["success"]),
        "wave_n": len(wave),
        "start_spread_ms": (max(starts) - min(starts)) * 1e3,
        "arrival_minus_start_ms": {"mean": sum(lag) / len(lag), "p50": pct(lag, 50), "p90": pct(lag, 90),
                                   "max": max(lag), "min": min(lag)},
        "first_start_to_kth_arrival_ms": {str(k): (arrivals[k - 1] - s0) * 1e3
                                          for k in (1, 8, 64, 256) if k <= len(arrivals)},
        "first_request": {
            "arrival_minus_start_ms": (s1["arrival"] - c1["start"]) * 1e3,
            "client_ttft_ms": c1["ttft"] * 1e3 if c1["ttft"] is not None else None,
            "server_first_chunk_minus_start_ms": (s1["first_chunk"] - c1["start"]) * 1e3,
        },
        "wave_client_ttft_ms": {"mean": sum(ttft_client) / len(ttft_client), "p50": pct(ttft_client, 50),
                                "p90": pct(ttft_client, 90), "max": max(ttft_client)},
        "wave_true_ttft_ms": {"mean": sum(ttft_truth) / len(ttft_truth), "p50": pct(ttft_truth, 50),
                              "p90": pct(ttft_truth, 90), "max": max(ttft_truth)},
        "wave_ttft_minus_truth_ms": {"mean": sum(ttft_excess) / len(ttft_excess), "p50": pct(ttft_excess, 50),
                                     "p90": pct(ttft_excess, 90), "max": max(ttft_excess)},
        "all_ttft_minus_truth_ms_mean": sum((c["ttft"] - (s["first_chunk"] - c["start"])) * 1e3
                                            for c, s in all_ok) / len(all_ok),
        "client_duration_s": client["duration"],
    }


# --------------------------------------------------------------------------------------------------------
# orchestration


def one_run(args, client: str, rnd: int, out_dir: Path) -> dict:
    tag = f"r{rnd}-{client}"
    server = subprocess.Popen([sys.executable, __file__, "_server", "--ttft", str(args.ttft), "--itl", str(args.itl)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = server.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"fake server did not start: {line!r}")
        base_url = f"http://127.0.0.1:{int(line.split()[1])}"
        prefix = f"intake-{tag}-"
        with tempfile.TemporaryDirectory() as td:
            client_json, server_json = Path(td) / "client.json", Path(td) / "server.json"
            cmd = [sys.executable, __file__, "_client", client, "--base-url", base_url, "--prefix", prefix,
                   "--client-out", str(client_json)] + common_argv(args)
            load_before = os.getloadavg()
            t = time.time()
            proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wall = time.time() - t
            if proc.returncode != 0:
                print(proc.stdout[-3000:], file=sys.stderr)
                raise RuntimeError(f"{tag}: client exited with {proc.returncode}")
            server.stdin.write(f"dump {server_json}\n")
            server.stdin.flush()
            if server.stdout.readline().strip() != "DUMPED":
                raise RuntimeError("fake server did not dump its records")
            cdata, sdata = json.loads(client_json.read_text()), json.loads(server_json.read_text())
    finally:
        if server.stdin and not server.stdin.closed:
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    res = analyze(cdata, sdata, args.wave)
    hashes = {r["request_id"]: r["prompt_sha1"] for r in sdata["records"] if r["request_id"]}
    res.update({"round": rnd, "wall_s": wall, "loadavg_before": load_before,
                "prompt_hashes_sha1": hashlib.sha1("".join(hashes[f"{prefix}{i}"] for i in range(args.num_prompts)
                                                           if f"{prefix}{i}" in hashes).encode()).hexdigest()[:12],
                "unlabelled_server_requests": sum(1 for r in sdata["records"] if not r["request_id"])})
    raw = {"client": cdata, "server": sdata}
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    (out_dir / "raw" / f"{tag}.json").write_text(json.dumps(raw))
    return res


def common_argv(args) -> list[str]:
    return ["--tokenizer", args.tokenizer, "--vllm-root", args.vllm_root, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-concurrency", str(args.max_concurrency), "--num-warmups", str(args.num_warmups),
            "--request-rate", str(args.request_rate)]


def fmt_row(r: dict) -> str:
    a, k, f = r["arrival_minus_start_ms"], r["first_start_to_kth_arrival_ms"], r["first_request"]
    return (f"| {r['round']} | {r['client']} | {r['start_spread_ms']:.1f} | {a['mean']:.1f} | {a['p50']:.1f} | "
            f"{a['p90']:.1f} | {a['max']:.1f} | " + " | ".join(f"{k[n]:.1f}" if n in k else "-" for n in ("1", "8", "64", "256"))
            + f" | "
            f"{r['wave_ttft_minus_truth_ms']['mean']:.2f} | {r['wave_client_ttft_ms']['mean']:.1f} | "
            f"{f['client_ttft_ms']:.1f} |")


HEADER = ("| round | client | start spread | arr-start mean | p50 | p90 | max | 1st arr | 8th | 64th | 256th | "
          "TTFT-truth mean | client TTFT mean | 1st req TTFT |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def orchestrate(args) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for c in args.clients:
        if c not in ALL_CLIENTS:
            raise SystemExit(f"unknown client {c}; choose from {ALL_CLIENTS}")
    if "pd-uvloop" in args.clients:
        chk = subprocess.run([sys.executable, "-c", "import uvloop"], capture_output=True)
        if chk.returncode != 0:
            raise SystemExit("pd-uvloop needs uvloop importable (pip install uvloop, or PYTHONPATH to one)")
    results = []
    t_all = time.time()
    for rnd in range(1, args.rounds + 1):
        for client in args.clients:
            r = one_run(args, client, rnd, out_dir)
            results.append(r)
            print(fmt_row(r), flush=True)
            time.sleep(args.pause)
    summary = {
        "setup": {"ttft_s": args.ttft, "itl_s": args.itl, "request_rate": args.request_rate, "output_len": args.output_len, "input_len": args.input_len,
                  "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                  "num_warmups": args.num_warmups, "wave": args.wave, "rounds": args.rounds,
                  "python": sys.version.split()[0], "cpus": os.cpu_count(), "total_wall_s": time.time() - t_all},
        "runs": results,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(HEADER)
    for r in results:
        print(fmt_row(r))
    print(f"wrote {out_dir / 'summary.json'}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")

    def common(q):
        q.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
        q.add_argument("--vllm-root", default=DEFAULT_VLLM_ROOT)
        q.add_argument("--num-prompts", type=int, default=512)
        q.add_argument("--input-len", type=int, default=1024)
        q.add_argument("--output-len", type=int, default=64)
        q.add_argument("--max-concurrency", type=int, default=256)
        q.add_argument("--num-warmups", type=int, default=2)
        q.add_argument("--request-rate", type=float, default=float("inf"),
                       help="Poisson arrivals at this many requests/s (both clients seed 0), else all at once")

    s = sub.add_parser("_server")
    s.add_argument("--ttft", type=float, required=True)
    s.add_argument("--itl", type=float, required=True)
    c = sub.add_parser("_client")
    c.add_argument("client", choices=ALL_CLIENTS)
    c.add_argument("--base-url", required=True)
    c.add_argument("--prefix", required=True)
    c.add_argument("--client-out", required=True)
    common(c)
    # the orchestrator's own flags
    common(p)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "lease_s11" / "client_intake"))
    p.add_argument("--clients", type=lambda s: s.split(","), default=list(CLIENTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--wave", type=int, default=256, help="analyse the first N requests by start time")
    p.add_argument("--ttft", type=float, default=0.05, help="fake server: first token this long after arrival")
    p.add_argument("--itl", type=float, default=0.03, help="fake server: then one token every this many seconds")
    p.add_argument("--pause", type=float, default=1.0, help="idle seconds between runs")
    args = p.parse_args()
    if args.cmd == "_server":
        return serve(args)
    if args.cmd == "_client":
        if args.client in VLLM_VARIANTS:
            return run_vllm_client(args)
        args.no_uvloop = args.client.startswith("pd-asyncio")
        return run_pdserve_client(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())

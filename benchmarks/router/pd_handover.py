"""Handover latency and TTFT of a local 1P1D deployment (run on a 2-GPU host, e.g. 2xH200).

Starts `pdserve serve --prefill 1 --decode 1` (prefill on GPU 0, decode on GPU 1, router in front), then, for each
prompt length, sends one request at a time with fresh random prompts (no prefix-cache hits) along four paths:

  pd_direct     straight to the decode instance with `pd` naming the prefill instance: the decode instance's
                `pd_timings` (queue, prefill, handover = prefill done -> KV landed, first token) per request
  router        through the router (what a client sees): TTFT
  prefill_alone the prefill instance serving the request by itself (colocated): TTFT, the baseline
  decode_local  the decode instance prefilling by itself: TTFT (what conditional disaggregation falls back to)

and writes p50/p90/p99/mean per metric and length to a JSON file (with the command line and the GPUs), plus a
markdown table on stdout. Prompts are random token ids (exact lengths with any model), so use `--load-format dummy`
and a model directory with the real shapes (e.g. shared/anchors/make_dummy_model_dir.py).

Example (2xH200):
  python benchmarks/router/pd_handover.py --model /path/to/qwen3-8b-dummy --load-format dummy \\
      --max-model-len 33024 --prompt-lens 1024 8192 32768 --num-requests 20 --out $OUT/pd_handover.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from pdserve import stats
from pdserve.signing import sign_request

ROOT = Path(__file__).resolve().parents[2]
SECRET = secrets.token_urlsafe(32)  # this run's deployment secret: the launcher and the pd_direct requests share it
PATHS = ("pd_direct", "router", "prefill_alone", "decode_local")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--max-model-len", type=int, default=33024)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--num-requests", type=int, default=20, help="measured requests per length and path")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per length and path first")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--token-range", type=int, nargs=2, default=[1000, 20000], metavar=("LOW", "HIGH"),
                   help="random prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--instance-args", default="", help="extra flags for both instances (one string)")
    p.add_argument("--launcher-args", default="", help="extra flags for `pdserve serve` itself, e.g. --isolate-gpus")
    p.add_argument("--out", default=None, help="JSON results (default: benchmarks/router/results/<time>.json)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    xs = sorted(values)
    p50, p90, p99 = stats.percentiles(xs, (50, 90, 99))
    return {"n": len(xs), "p50": p50, "p90": p90, "p99": p99, "mean": stats.mean(xs),
            "min": xs[0], "max": xs[-1]}


class Deployment:
    """`python -m pdserve.router.launcher --prefill 1 --decode 1` as a child; URLs parsed from its output."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "pdserve.router.launcher", "--prefill", "1", "--decode", "1", "--port", "0",
               "--model", args.model, "--load-format", args.load_format, "--max-model-len", str(args.max_model_len),
               "--local-prefill-max-tokens", "0", "--startup-timeout", str(args.startup_timeout),
               *args.launcher_args.split(), *args.instance_args.split()]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_DEPLOYMENT_SECRET": SECRET},
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.urls: dict[str, str] = {}
        self.router = ""

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.output.append(line)
            sys.stderr.write("  | " + line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            m = re.search(r"started (\w+) \(pid \d+, [^)]*\) on (http://\S+),", line)
            if m:
                self.urls[m.group(1)] = m.group(2)
            m = re.search(r"ready: send OpenAI requests to (http://\S+)/v1", line)
            if m:
                self.router = m.group(1)
                return
        raise RuntimeError("the deployment did not become ready:\n" + "".join(self.output[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                         timeout: float) -> dict[str, Any]:
    """One streamed completion: client TTFT and, when present, the pd_timings of the usage chunk. A body with
    `pd` is signed with the deployment secret, as the router signs it (an instance refuses it unsigned)."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if "pd" in body:
        headers.update(sign_request(SECRET.encode(), "POST", "/v1/completions", data))
    t0 = time.perf_counter()
    ttft = None
    timings = None
    async with session.post(url + "/v1/completions", data=data, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:300]}"}
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                obj = json.loads(event[6:])
                if "error" in obj:
                    return {"error": json.dumps(obj["error"])[:300]}
                if ttft is None and obj.get("choices"):
                    ttft = time.perf_counter() - t0
                usage = obj.get("usage") or {}
                timings = obj.get("pd_timings") or usage.get("pd_timings") or timings
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "pd_timings": timings}


async def measure(args: argparse.Namespace, dep: Deployment) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefill_url, decode_url = dep.urls["prefill0"], dep.urls["decode0"]
    targets = {"pd_direct": decode_url, "router": dep.router, "prefill_alone": prefill_url,
               "decode_local": decode_url}
    results: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for n in args.prompt_lens:
            samples: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
            errors: dict[str, list[str]] = {p: [] for p in PATHS}
            for i in range(args.warmup + args.num_requests):
                for path in PATHS:
                    ids = [rng.randrange(*args.token_range) for _ in range(n)]
                    body: dict[str, Any] = {"prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                                            "ignore_eos": True, "stream": True,
                                            "stream_options": {"include_usage": True}}
                    if path == "pd_direct":
                        body["pd"] = {"prefill_urls": [prefill_url], "request_id": f"bench-{uuid.uuid4().hex}"}
                    try:
                        r = await stream_request(session, targets[path], body, args.request_timeout)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        r = {"error": repr(e)}
                    if i < args.warmup:
                        continue
                    if "error" in r:
                        errors[path].append(r["error"])
                    else:
                        samples[path].append(r)
            summary: dict[str, Any] = {}
            for path in PATHS:
                summary[f"ttft_{path}_s"] = percentiles([s["ttft_s"] for s in samples[path] if s["ttft_s"]])
            timings = [s["pd_timings"] for s in samples["pd_direct"] if isinstance(s.get("pd_timings"), dict)]
            for phase in ("queue_s", "prefill_s", "handover_s", "first_token_s", "push_start_s", "push_landed_s",
                          "admit_s", "push_s"):
                summary[phase] = percentiles([t[phase] for t in timings if isinstance(t.get(phase), (int, float))])
            # what is not compute or KV movement: the order's way from the decode instance's arrival to the prefill
            # engine (first_token - queue - prefill - handover), and the first token's way out to the client
            phases = ("queue_s", "prefill_s", "handover_s", "first_token_s")
            whole = [(s, s["pd_timings"]) for s in samples["pd_direct"] if isinstance(s.get("pd_timings"), dict)
                     and all(isinstance(s["pd_timings"].get(k), (int, float)) for k in phases)]
            summary["order_path_s"] = percentiles([t["first_token_s"] - t["queue_s"] - t["prefill_s"] - t["handover_s"]
                                                   for _, t in whole])
            summary["first_token_out_s"] = percentiles([s["ttft_s"] - t["first_token_s"] for s, t in whole
                                                        if s["ttft_s"]])
            summary["fallbacks"] = sum(1 for t in timings if t.get("fallback"))
            transports: dict[str, int] = {}
            for t in timings:
                name = str(t.get("transport"))
                transports[name] = transports.get(name, 0) + 1
            summary["transports"] = transports  # as the prefill instance reported each push
            summary["pd_timings_missing"] = len(samples["pd_direct"]) - len(timings)
            if summary["pd_timings_missing"]:
                print(f"WARNING: {summary['pd_timings_missing']} pd_direct answers carried no pd_timings: the decode "
                      "instance did not report them (no handover, or its server does not add pd_timings)", file=sys.stderr, flush=True)
            summary["errors"] = {p: e[:5] for p, e in errors.items() if e}
            summary["num_errors"] = {p: len(e) for p, e in errors.items() if e}
            results[str(n)] = summary
            print(f"prompt {n}: " + json.dumps({k: (v["p50"] if isinstance(v, dict) and "p50" in v else v)
                                                for k, v in summary.items()}), file=sys.stderr, flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    def ms(stats: dict | None, key: str) -> str:
        return f"{stats[key] * 1000:.1f}" if stats else "-"

    rows = ["| prompt | handover p50 / p99 ms | prefill p50 ms | TTFT router p50 / p99 ms | TTFT prefill alone p50 "
            "/ p99 ms | router - alone p50 ms | TTFT decode local p50 ms | errors |",
            "|---|---|---|---|---|---|---|---|"]
    for n, s in results.items():
        r, a = s["ttft_router_s"], s["ttft_prefill_alone_s"]
        diff = f"{(r['p50'] - a['p50']) * 1000:+.1f}" if r and a else "-"
        rows.append(f"| {n} | {ms(s['handover_s'], 'p50')} / {ms(s['handover_s'], 'p99')} | "
                    f"{ms(s['prefill_s'], 'p50')} | {ms(r, 'p50')} / {ms(r, 'p99')} | {ms(a, 'p50')} / {ms(a, 'p99')} "
                    f"| {diff} | {ms(s['ttft_decode_local_s'], 'p50')} | {s['num_errors'] or 0} |")
    return "\n".join(rows)


def gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def main() -> int:
    args = parse_args()
    dep = Deployment(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        dep.wait_ready(args.startup_timeout)
        results = asyncio.run(measure(args, dep))
    finally:
        dep.stop()
    doc = {"benchmark": "pd_handover", "started": started, "command": [sys.executable, *sys.argv],
           "deployment": dep.cmd, "gpus": gpu_names(), "args": vars(args), "results": results}
    out = Path(args.out) if args.out else ROOT / "benchmarks/router/results" / f"pd_handover_{started}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(table(results))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

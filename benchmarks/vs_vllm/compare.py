"""Ratios of pdserve to vLLM from one side-by-side run (side_by_side.sh): every workload measured by vLLM's own
`bench serve` on both, plus start-up time and KV capacity of each server.

    python benchmarks/vs_vllm/compare.py --dir $OUT --out $OUT/comparison.json   # the comparison, as a table too
    python benchmarks/vs_vllm/compare.py --line $OUT/vllm_single_1024x1024_c256.json   # one summary line

Where a result file keeps its per-request lists (`ttfts`, `itls`, `output_lens`), each engine's entry also gets
"stream": metrics of how the tokens arrived (see stream()). vLLM's server sends several tokens in its first chunk,
which makes its TTFT later and its TPOT = (e2e - TTFT) / (out - 1) smaller than its real gap between tokens; the
steady gap and the steady TPOT count only the real gaps between chunks.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

RESULT = re.compile(r"^(vllm|pdserve)_(\w+?)_(\d+)x(\d+)_c(\d+)((?:_rate[\d.]+)?)\.json$")  # _rate<R>: Poisson
SERVER = re.compile(r"^(vllm|pdserve)_(\w+)_server\.json$")
CLIENT = re.compile(r"^((?:vllm|pdserve)_\w+?_\d+x\d+_c\d+(?:_rate[\d.]+)?)_pdclient\.json$")  # pdserve's client, same server and workload
# any client's file of any round: <run>[_r<k>][_pdclient].json
ROUND = re.compile(r"^((?:vllm|pdserve)_\w+?_\d+x\d+_c\d+(?:_rate[\d.]+)?)(?:_r(\d+))?(_pdclient)?\.json$")
CLIENT_METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                  "request_throughput")
METRICS = ("output_throughput", "mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms", "mean_itl_ms",
           "mean_e2el_ms", "request_throughput")
BURST_S = 0.5e-3  # gaps between chunks this short (s) are tokens of one burst split into several SSE events


def line(path: Path) -> str:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path.stem:40s} no result ({e})"
    return (f"{path.stem:40s} ok {d['completed']}/{d['completed'] + d['failed']}  out tok/s "
            f"{d['output_throughput']:9.1f}  TTFT mean/p90 {d['mean_ttft_ms']:8.1f}/{d['p90_ttft_ms']:8.1f} ms  "
            f"TPOT mean/p90 {d['mean_tpot_ms']:6.2f}/{d['p90_tpot_ms']:6.2f} ms")


def _commit() -> str | None:
    if os.environ.get("PDSERVE_GIT_COMMIT"):
        return os.environ["PDSERVE_GIT_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def _gpus(folder: Path | None = None) -> list[str]:
    """The GPUs of the run: the folder's gpus.txt (`nvidia-smi -L` written by the lease script on the machine that
    ran it) where there is one, so a comparison made afterwards on another machine names the right GPUs."""
    if folder is not None and (folder / "gpus.txt").is_file():
        return (folder / "gpus.txt").read_text().strip().splitlines()
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def stream(d: dict) -> dict | None:
    """Stream metrics from a result file's per-request lists (`ttfts` s, `itls` list of lists of s, `output_lens`);
    None when any list is missing or no request has output. Requests with no output or no TTFT (failed) are left out.

    - mean_e2el_ms: mean of TTFT + sum(itls), per request.
    - chunks_per_request: mean of len(itls) + 1 (the chunks a request's tokens arrived in).
    - first_chunk_tokens: mean of max(1, output_len - len(itls)), the tokens that came with the first chunk if only
      the first chunk bunched: an upper bound on the first chunk's tokens, exact when every later chunk carries one
      token each.
    - steady_gap_ms: median over requests of the median of the request's gaps between chunks longer than BURST_S
      (shorter gaps, a few microseconds, are one burst split into several SSE events); a request with no such gap
      has none and is left out; None when no request has one.
    - tpot_steady_ms: mean over requests of (e2e - TTFT) / (the request's gaps longer than BURST_S): time per token
      after the first chunk, counting as tokens only the real gaps (a burst counts as one); requests with no such gap
      are left out; None when no request has one.
    """
    ttfts, itls, outs = d.get("ttfts"), d.get("itls"), d.get("output_lens")
    if not isinstance(ttfts, list) or not isinstance(itls, list) or not isinstance(outs, list):
        return None
    e2e, chunks, first, gaps, steady = [], [], [], [], []
    for t, i, o in zip(ttfts, itls, outs):
        if not o or t is None or i is None:
            continue
        e = t + sum(i)
        e2e.append(e)
        chunks.append(len(i) + 1)
        first.append(max(1, o - len(i)))
        real = [g for g in i if g > BURST_S]
        if real:
            gaps.append(statistics.median(real))
            steady.append((e - t) / len(real))
    if not e2e:
        return None
    return {"requests": len(e2e), "mean_e2el_ms": 1e3 * statistics.fmean(e2e),
            "chunks_per_request": statistics.fmean(chunks), "first_chunk_tokens": statistics.fmean(first),
            "steady_gap_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "tpot_steady_ms": 1e3 * statistics.fmean(steady) if steady else None}


def _stream_value(x: dict | None, k: str) -> float | None:
    return ((x or {}).get("stream") or {}).get(k)


def _server_mean(x: dict | None, k: str) -> float | None:
    """A run's mean (ms) of the server's own histogram k ("ttft", "itl", "tpot", "e2el"), if it was scraped."""
    return (((x or {}).get("server") or {}).get(k) or {}).get("mean_ms")


def e2el_pair(v: dict | None, p: dict | None) -> tuple[float | None, float | None]:
    """Mean E2E latency (ms) of vLLM and pdserve from one source for both: the files' own mean_e2el_ms where both
    have it, else the per-request lists' (stream's)."""
    a, b = (v or {}).get("mean_e2el_ms"), (p or {}).get("mean_e2el_ms")
    if a is not None and b is not None:
        return a, b
    return _stream_value(v, "mean_e2el_ms"), _stream_value(p, "mean_e2el_ms")


def compare(folder: Path) -> dict:
    runs: dict[tuple[str, str], dict] = {}
    for f in sorted(folder.iterdir()):
        m = RESULT.match(f.name)
        if not m:
            continue
        engine, mode, i, o, c, rate = m.groups()
        d = json.loads(f.read_text())
        key = (mode, f"{i}x{o}_c{c}{rate}")
        sf = f.with_name(f.name[: -len(".json")] + ".server.json")  # the server's own histograms (server_latency.py)
        runs.setdefault(key, {})[engine] = {k: d.get(k) for k in METRICS} | {
            "completed": d.get("completed"), "failed": d.get("failed"), "file": f.name, "stream": stream(d),
            "server": json.loads(sf.read_text()) if sf.exists() else None}
    servers: dict[str, dict] = {}
    for f in sorted(folder.iterdir()):
        m = SERVER.match(f.name)
        if m:
            engine, mode = m.groups()
            servers.setdefault(mode, {})[engine] = json.loads(f.read_text())
    rows = []
    for (mode, workload), got in sorted(runs.items()):
        v, p = got.get("vllm"), got.get("pdserve")
        row = {"mode": mode, "workload": workload, "vllm": v, "pdserve": p}
        if v and p:
            ve, pe = e2el_pair(v, p)
            row["ratio"] = {
                "output_throughput": _ratio(p["output_throughput"], v["output_throughput"]),
                "mean_ttft": _ratio(p["mean_ttft_ms"], v["mean_ttft_ms"]),
                "mean_tpot": _ratio(p["mean_tpot_ms"], v["mean_tpot_ms"]),
                "mean_e2el": _ratio(pe, ve),
                "steady_gap": _ratio(_stream_value(p, "steady_gap_ms"), _stream_value(v, "steady_gap_ms")),
                "server_itl": _ratio(_server_mean(p, "itl"), _server_mean(v, "itl")),
            }
        rows.append(row)
    server_rows = []
    for mode, got in sorted(servers.items()):
        v, p = got.get("vllm"), got.get("pdserve")
        server_rows.append({"mode": mode, "vllm": v, "pdserve": p, "ratio": {
            "startup_s": _ratio((p or {}).get("startup_s"), (v or {}).get("startup_s")),
            "kv_tokens": _ratio((p or {}).get("kv_tokens"), (v or {}).get("kv_tokens"))}})
    clients = []
    for f in sorted(folder.iterdir()):
        m = CLIENT.match(f.name)
        base = folder / f"{m.group(1)}.json" if m else None
        if base is None or not base.exists():
            continue
        v, p = json.loads(base.read_text()), json.loads(f.read_text())
        clients.append({"run": m.group(1), "vllm_client": {k: v.get(k) for k in CLIENT_METRICS},
                        "pdserve_client": {k: p.get(k) for k in CLIENT_METRICS},
                        "ratio": {k: _ratio(p.get(k), v.get(k)) for k in CLIENT_METRICS}})
    return {"benchmark": "vs_vllm", "date": dt.datetime.now(dt.timezone.utc).isoformat(), "commit": _commit(),
            "gpus": _gpus(folder), "command": sys.argv, "workloads": rows, "servers": server_rows, "clients": clients,
            "client_rounds": client_rounds(folder)}


def client_rounds(folder: Path) -> list[dict]:
    """Runs measured by both clients in several alternating rounds (side_by_side.sh CLIENT_ROUNDS): per metric, each
    client's values in round order, the ratio of pdserve's client's mean to vLLM's client's, and each client's drift
    between its own rounds (max / min - 1), which says how much of the clients' difference the server's own
    run-to-run change could explain."""
    got: dict[str, dict[str, dict[int, dict]]] = {}
    for f in sorted(folder.iterdir()):
        m = ROUND.match(f.name)
        if m:
            run, k, pd = m.group(1), int(m.group(2) or 1), bool(m.group(3))
            got.setdefault(run, {}).setdefault("pdserve" if pd else "vllm", {})[k] = json.loads(f.read_text())
    out = []
    for run, by in sorted(got.items()):
        v, p = by.get("vllm", {}), by.get("pdserve", {})
        if len(v) < 2 or len(p) < 2:
            continue
        row: dict = {"run": run, "rounds": max(len(v), len(p)), "metrics": {}}
        for k in CLIENT_METRICS:
            a = [v[i].get(k) for i in sorted(v) if isinstance(v[i].get(k), (int, float))]
            b = [p[i].get(k) for i in sorted(p) if isinstance(p[i].get(k), (int, float))]
            if not a or not b:
                continue
            row["metrics"][k] = {"vllm_client": a, "pdserve_client": b,
                                 "ratio_of_means": _ratio(sum(b) / len(b), sum(a) / len(a)),
                                 "drift_vllm_client": max(a) / min(a) - 1 if min(a) > 0 else None,
                                 "drift_pdserve_client": max(b) / min(b) - 1 if min(b) > 0 else None}
        out.append(row)
    return out


def table(c: dict) -> str:
    out = ["| mode | workload | vLLM out tok/s | pdserve out tok/s | ratio | mean TTFT vLLM / pdserve ms | "
           "mean TPOT vLLM / pdserve ms | mean E2E vLLM / pdserve ms | steady gap vLLM / pdserve ms |",
           "|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return fmt.format(x) if isinstance(x, (int, float)) else "-"

    for r in c["workloads"]:
        v, p, q = r.get("vllm") or {}, r.get("pdserve") or {}, r.get("ratio") or {}
        ve, pe = e2el_pair(v, p)
        vg, pg = _stream_value(v, "steady_gap_ms"), _stream_value(p, "steady_gap_ms")
        out.append(f"| {r['mode']} | {r['workload']} | {f(v.get('output_throughput'))} | "
                   f"{f(p.get('output_throughput'))} | {f(q.get('output_throughput'), '{:.2f}')} | "
                   f"{f(v.get('mean_ttft_ms'))} / {f(p.get('mean_ttft_ms'))} | "
                   f"{f(v.get('mean_tpot_ms'), '{:.2f}')} / {f(p.get('mean_tpot_ms'), '{:.2f}')} | "
                   f"{f(ve)} / {f(pe)} | {f(vg, '{:.2f}')} / {f(pg, '{:.2f}')} |")
    kinds = ("ttft", "itl", "tpot")
    if any((r.get(e) or {}).get("server") for r in c["workloads"] for e in ("vllm", "pdserve")):
        out += ["", "| mode | workload | the servers' own means, vLLM / pdserve ms: TTFT | inter-token | TPOT a request |",
                "|---|---|---|---|---|"]
        for r in c["workloads"]:
            v, p = r.get("vllm"), r.get("pdserve")
            cells = [f"{f(_server_mean(v, k), '{:.2f}')} / {f(_server_mean(p, k), '{:.2f}')}" for k in kinds]
            out.append(f"| {r['mode']} | {r['workload']} | " + " | ".join(cells) + " |")
    for s in c["servers"]:
        v, p = s.get("vllm") or {}, s.get("pdserve") or {}
        out.append(f"| {s['mode']} | start-up s / KV tokens | {v.get('startup_s', '-')} / {v.get('kv_tokens', '-')} | "
                   f"{p.get('startup_s', '-')} / {p.get('kv_tokens', '-')} | | | | | |")
    if c.get("clients"):
        out += ["", "| server and workload | metric | vLLM's client | pdserve's client | pdserve / vLLM |",
                "|---|---|---|---|---|"]
        for r in c["clients"]:
            for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
                a, b, q = r["vllm_client"].get(k), r["pdserve_client"].get(k), r["ratio"].get(k)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    out.append(f"| {r['run']} | {k} | {a:.2f} | {b:.2f} | {q:.3f} |")
    if c.get("client_rounds"):
        out += ["", "| server and workload | metric | vLLM's client by round | pdserve's client by round | "
                "ratio of means | drift vLLM's / pdserve's |", "|---|---|---|---|---|---|"]
        for r in c["client_rounds"]:
            for k, m in r["metrics"].items():
                a = ", ".join(f"{x:.2f}" for x in m["vllm_client"])
                b = ", ".join(f"{x:.2f}" for x in m["pdserve_client"])
                out.append(f"| {r['run']} | {k} | {a} | {b} | {m['ratio_of_means']:.3f} | "
                           f"{100 * m['drift_vllm_client']:.1f} % / {100 * m['drift_pdserve_client']:.1f} % |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--line", type=Path)
    a = ap.parse_args()
    if a.line:
        print(line(a.line))
        return 0
    c = compare(a.dir)
    if a.out:
        a.out.write_text(json.dumps(c, indent=1))
    print(table(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())

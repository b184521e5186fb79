"""A running server's timeline while a client drives it: the CPU use of each of its processes and the engine's queue.

Why: the engine alone takes a burst of 256 prompts of 1024 tokens in the same time vLLM's server does
(bench_steps.py --burst), yet the served TTFT at concurrency 256 is higher. This tells where a request waits once
the client sent it: in the HTTP process (its CPU near one core: tokenizing, detokenizing, SSE writes), in the
engine process (its CPU near one core: scheduling, output building) or in the engine's waiting queue (/load).

Polls every `--interval` s until SIGINT/SIGTERM or `--duration`: /load (running, waiting, steps) and, for the
server's process and each descendant, its CPU seconds (/proc/PID/stat utime + stime). Writes the samples and a
summary (per process: CPU utilisation over the busy window and its highest one-second value).

  pdserve serve ... & python benchmarks/server/serve_timeline.py --url http://127.0.0.1:8200 --pid $! \
      --out $OUT/timeline.json &  (then run the client; kill -INT the timeline when it ends)

--waves RECORD splits a `pdserve bench serve` record's requests (its <name>.pdserve.json) into the first wave (the
first max-concurrency requests to start, sent at once) and the rest, and prints each one's TTFT percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float | None:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def name_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    return f"{comm}: {cmd[:120]}"


def load(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/load", timeout=2) as r:
            return json.loads(r.read())
    except Exception as e:  # a busy or stopping server: the sample records it
        return {"error": str(e)[:100]}


def summarize(samples: list[dict], names: dict[int, str]) -> dict:
    """Per process: CPU seconds over the busy window (from the first to the last sample with running requests),
    that divided by the window, and the highest rate between samples one second or more apart."""
    busy = [s for s in samples if s["load"].get("num_running", 0) or s["load"].get("num_waiting", 0)]
    if len(busy) < 2:
        return {"busy_window_s": 0.0, "processes": {}}
    a, b = busy[0], busy[-1]
    window = b["t"] - a["t"]
    procs = {}
    for pid in names:
        key = str(pid)
        if key not in a["cpu"] or key not in b["cpu"]:
            continue
        peak, j = 0.0, 0
        for i, s in enumerate(busy):
            while j < i and s["t"] - busy[j]["t"] > 1.0:
                j += 1
            if j > 0 and key in busy[j - 1]["cpu"] and key in s["cpu"]:
                dt = s["t"] - busy[j - 1]["t"]
                peak = max(peak, (s["cpu"][key] - busy[j - 1]["cpu"][key]) / dt)
        procs[key] = {"name": names[pid], "cpu_s": b["cpu"][key] - a["cpu"][key],
                      "utilisation": (b["cpu"][key] - a["cpu"][key]) / window, "peak_1s": peak}
    waiting = [s["load"].get("num_waiting", 0) for s in busy]
    return {"busy_window_s": window, "processes": procs, "max_waiting": max(waiting),
            "steps": b["load"].get("num_steps", 0) - a["load"].get("num_steps", 0)}


def request_rows(obj) -> list[dict]:
    """The per-request samples anywhere in a bench record (dicts with 'start' and 'ttft')."""
    if isinstance(obj, list):
        if obj and all(isinstance(x, dict) and "ttft" in x and "start" in x for x in obj):
            return obj
        return [r for x in obj for r in request_rows(x)]
    if isinstance(obj, dict):
        return [r for x in obj.values() for r in request_rows(x)]
    return []


def waves(path: str) -> dict:
    rec = json.loads(Path(path).read_text())
    rows = sorted((r for r in request_rows(rec) if r.get("ttft") is not None and r.get("start") is not None),
                  key=lambda r: r["start"])
    conc = int((rec.get("args") or {}).get("max_concurrency") or 0) or len(rows)
    out = {}
    for name, part in (("first wave", rows[:conc]), ("the rest", rows[conc:])):
        if not part:
            continue
        t = sorted(r["ttft"] for r in part)
        pct = {p: t[min(len(t) - 1, int(p / 100 * len(t)))] for p in (50, 90, 99)}
        out[name] = {"requests": len(t), "mean_s": sum(t) / len(t), **{f"p{p}_s": v for p, v in pct.items()},
                     "max_s": t[-1], "start_span_s": part[-1]["start"] - part[0]["start"]}
        print(f"{name}: {len(t)} requests started over {out[name]['start_span_s']:.2f} s; TTFT mean "
              f"{out[name]['mean_s']:.2f} s, p50 {pct[50]:.2f}, p90 {pct[90]:.2f}, p99 {pct[99]:.2f}, max {t[-1]:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waves", metavar="RECORD", help="print a client record's TTFT by wave, and exit")
    ap.add_argument("--url")
    ap.add_argument("--pid", type=int, help="the server's process (its descendants are found)")
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.waves:
        waves(args.waves)
        return 0
    if not (args.url and args.pid and args.out):
        ap.error("--url, --pid and --out are needed (or --waves RECORD)")
    stop = [False]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.__setitem__(0, True))
    names: dict[int, str] = {}
    samples = []
    t0 = time.monotonic()
    while not stop[0] and time.monotonic() - t0 < args.duration:
        pids = descendants(args.pid)
        for p in pids:
            names.setdefault(p, name_of(p))
        cpu = {str(p): c for p in pids if (c := cpu_seconds(p)) is not None}
        samples.append({"t": time.monotonic() - t0, "cpu": cpu, "load": load(args.url)})
        time.sleep(args.interval)
    summary = summarize(samples, names)
    Path(args.out).write_text(json.dumps({"kind": "serve_timeline", "args": vars(args), "summary": summary,
                                          "samples": samples}))
    for pid, p in summary["processes"].items():
        print(f"{pid} {p['utilisation']:.2f} CPU over the busy window (peak {p['peak_1s']:.2f}): {p['name']}")
    print(f"busy window {summary['busy_window_s']:.1f} s, {summary.get('steps', 0)} engine steps, "
          f"most waiting {summary.get('max_waiting', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

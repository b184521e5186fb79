"""What people read: the console summary in vLLM's layout, and CSV and markdown tables of runs and trials."""

from __future__ import annotations

import csv
import io
import math

from pdserve.bench.metrics import pct_name
from pdserve.bench.record import as_float

_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}f}"
    return str(x)


def console_summary(run: dict, percentile_metrics=("ttft", "tpot", "itl"), metric_percentiles=(99.0,)) -> str:
    m, c = run["metrics"], run["config"]
    out = io.StringIO()

    def line(label: str, value) -> None:
        out.write(f"{label:<40} {_fmt(value):<10}\n")

    out.write("{s:{c}^{n}}\n".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", m["completed"])
    line("Failed requests:", m["failed"])
    line("Request rate configured (RPS):", _fmt(as_float(c["request_rate"])))
    line("Maximum request concurrency:", c.get("max_concurrency") or "inf")
    line("Benchmark duration (s):", m["duration"])
    line("Total input tokens:", m["total_input_tokens"])
    line("Total generated tokens:", m["total_output_tokens"])
    line("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        line("Request goodput (req/s):", m["request_goodput"])
    line("Output token throughput (tok/s):", m["output_throughput"])
    line("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    line("Peak concurrent requests:", m["max_concurrent_requests"])
    line("Total Token throughput (tok/s):", m["total_token_throughput"])
    cap = run.get("client_capacity")
    if cap:
        line("Client capacity (req/s):", cap["request_throughput"])
        line("Client capacity (tok/s):", cap["output_throughput"])
    for metric in percentile_metrics:
        name = metric.upper()
        out.write("{s:{c}^{n}}\n".format(s=_TITLES[metric], n=50, c="-"))
        line(f"Mean {name} (ms):", m[f"mean_{metric}_ms"])
        line(f"Median {name} (ms):", m[f"median_{metric}_ms"])
        for p in metric_percentiles:
            line(f"P{pct_name(p)} {name} (ms):", m.get(f"p{pct_name(p)}_{metric}_ms"))
    if m["failure_reasons"]:
        out.write("{s:{c}^{n}}\n".format(s="Failures", n=50, c="-"))
        for kind, info in sorted(m["failure_reasons"].items(), key=lambda kv: -kv[1]["count"]):
            line(f"{kind}:", info["count"])
            out.write(f"  e.g. {info['example'][:200]}\n")
    out.write("=" * 50 + "\n")
    if run.get("stop_reason"):
        out.write(f"Stopped early: {run['stop_reason']} ({run['num_sent']} of {run['num_planned']} requests sent)\n")
    for w in run.get("warnings", []):
        out.write(f"WARNING: {w}\n")
    return out.getvalue()


def _trial_by_run(record: dict) -> dict[int, dict]:
    out = {}
    for s in record.get("searches", []):
        for t in s["trials"]:
            if t.get("run_index") is not None:
                out[t["run_index"]] = t
    return out


def run_rows(record: dict) -> list[dict]:
    """One flat row per run (plus its SLO verdict when it was a search trial)."""
    trials = _trial_by_run(record)
    rows = []
    for i, run in enumerate(record["runs"]):
        m, c = run["metrics"], run["config"]
        row = {
            "label": run.get("label", ""),
            "dataset": c.get("dataset_name"),
            "input_len": c.get("random_input_len"),
            "output_len": c.get("random_output_len"),
            "request_rate": c.get("request_rate"),
            "max_concurrency": c.get("max_concurrency"),
            "num_sent": run.get("num_sent"),
            "completed": m["completed"],
            "failed": m["failed"],
            "duration_s": m["duration"],
            "request_throughput": m["request_throughput"],
            "request_goodput": m.get("request_goodput"),
            "output_throughput": m["output_throughput"],
            "total_token_throughput": m["total_token_throughput"],
            "max_output_tokens_per_s": m["max_output_tokens_per_s"],
            "max_concurrent_requests": m["max_concurrent_requests"],
        }
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p90", "p99"):
                row[f"{stat}_{metric}_ms"] = m.get(f"{stat}_{metric}_ms")
        if i in trials:
            row["slo_passed"] = trials[i]["passed"]
            row["slo_reason"] = trials[i]["reason"]
        rows.append(row)
    return rows


def to_csv(record: dict) -> str:
    rows = run_rows(record)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(v, 4) if isinstance(v, float) else ("" if v is None else v) for k, v in r.items()})
    return out.getvalue()


_MD_COLS = [
    ("label", "run"), ("input_len", "in"), ("output_len", "out"), ("request_rate", "rate"),
    ("completed", "ok"), ("failed", "fail"), ("request_throughput", "req/s"), ("request_goodput", "goodput"),
    ("output_throughput", "out tok/s"), ("median_ttft_ms", "p50 TTFT ms"), ("p90_ttft_ms", "p90 TTFT ms"),
    ("median_tpot_ms", "p50 TPOT ms"), ("p90_tpot_ms", "p90 TPOT ms"), ("p99_itl_ms", "p99 ITL ms"),
    ("slo_passed", "SLO"),
]


def to_markdown(record: dict) -> str:
    rows = run_rows(record)
    cols = [(k, h) for k, h in _MD_COLS if any(k in r and r[k] is not None for r in rows)]
    lines = [f"# pdserve bench {record.get('kind', '')}: {record.get('date', '')}", "",
             f"`{record.get('command', '')}` (commit {record.get('git_commit') or 'unknown'})", ""]
    for s in record.get("searches", []):
        lines.append(search_summary_line(s))
    if record.get("searches"):
        lines.append("")
    lines.append("| " + " | ".join(h for _, h in cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k)
            cells.append({True: "pass", False: "FAIL"}.get(v, "") if k == "slo_passed" and v is not None
                         else ("" if v is None else _fmt(v, 1)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def search_summary_line(s: dict) -> str:
    where = f" (input {s['input_len']})" if s.get("input_len") is not None else ""
    if s.get("max_rate") is None:
        return f"- SLO `{s['slo']}`{where}: no tested rate met it ({s['stop_reason']})"
    good = s.get("goodput")
    return (f"- SLO `{s['slo']}`{where}: max rate **{_fmt(as_float(s['max_rate']))} req/s**, goodput "
            f"{_fmt(good)} req/s, bracket [{_fmt(as_float(s['max_rate']))}, {_fmt(as_float(s.get('min_failed_rate')))}]"
            f", {len(s['trials'])} trials, stopped: {s['stop_reason']}")


def search_table(s: dict) -> str:
    out = io.StringIO()
    names = list(s["trials"][0]["values"].keys()) if s["trials"] and s["trials"][0]["values"] else []
    head = f"{'rate':>9} {'sent':>6} {'result':>7} " + " ".join(f"{n:>22}" for n in names) + f" {'goodput':>8}  reason"
    out.write(head + "\n")
    for t in s["trials"]:
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[t["passed"]]
        vals = " ".join(f"{_fmt(as_float(t['values'].get(n))):>22}" for n in names)
        out.write(f"{as_float(t['rate']):>9.3f} {t.get('num_sent', 0):>6} {verdict:>7} {vals} "
                  f"{_fmt(t.get('goodput')):>8}  {t['reason'][:90]}\n")
    out.write(search_summary_line(s).lstrip("- ").replace("**", "") + "\n")
    return out.getvalue()

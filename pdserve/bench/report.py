"""What people read: the console summary in vLLM's layout, and CSV and markdown tables of runs and trials."""

from __future__ import annotations

import csv
import io
import math

from pdserve.bench.record import as_float
from pdserve.bench.vllm_result import RunInfo, console_block


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
    """vLLM's result block for one run, then what pdserve adds: failures by kind, the client's capacity,
    why the run stopped early, warnings."""
    m, c = run["metrics"], run["config"]
    info = RunInfo(request_rate=as_float(c["request_rate"]), burstiness=as_float(c.get("burstiness", 1.0)),
                   max_concurrency=c.get("max_concurrency"), percentile_metrics=tuple(percentile_metrics),
                   metric_percentiles=tuple(metric_percentiles), goodput=m.get("request_goodput") is not None)
    out = io.StringIO()
    out.write(console_block(m, info))
    if m["failure_reasons"]:
        out.write("Failures by kind:\n")
        for kind, entry in sorted(m["failure_reasons"].items(), key=lambda kv: -kv[1]["count"]):
            out.write(f"  {kind}: {entry['count']} (e.g. {entry['example'][:200]})\n")
    cap = run.get("client_capacity")
    if cap:
        out.write(f"Client capacity: {_fmt(cap['request_throughput'])} req/s, "
                  f"{_fmt(cap['output_throughput'])} tok/s (a zero-work endpoint, same client)\n")
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


def search_summary_rows(record: dict) -> list[dict]:
    """One row per SLO search (per input length): the highest rate that met the SLO and what it achieved."""
    rows = []
    for s in record.get("searches", []):
        best = next((t for t in reversed(s["trials"]) if t["passed"] and t["rate"] == s["max_rate"]), None)
        m = record["runs"][best["run_index"]]["metrics"] if best and best.get("run_index") is not None else {}
        rows.append({
            "input_len": s.get("input_len"),
            "output_len": s.get("output_len"),
            "slo": s["slo"],
            "max_rate": s["max_rate"],
            "min_failed_rate": s.get("min_failed_rate"),
            "goodput": s.get("goodput"),
            "request_throughput": m.get("request_throughput"),
            "output_throughput": m.get("output_throughput"),
            "p90_ttft_ms": m.get("p90_ttft_ms"),
            "p90_tpot_ms": m.get("p90_tpot_ms"),
            "p99_ttft_ms": m.get("p99_ttft_ms"),
            "p99_tpot_ms": m.get("p99_tpot_ms"),
            "trials": len(s["trials"]),
            "stop_reason": s["stop_reason"],
        })
    return rows


_SUMMARY_COLS = [
    ("input_len", "input len"), ("output_len", "output len"), ("max_rate", "max rate (req/s)"),
    ("min_failed_rate", "lowest failing rate"), ("goodput", "goodput (req/s)"),
    ("output_throughput", "out tok/s"), ("p90_ttft_ms", "p90 TTFT ms"), ("p90_tpot_ms", "p90 TPOT ms"),
    ("trials", "trials"), ("stop_reason", "stopped"),
]


def search_summary_markdown(record: dict) -> str:
    rows = search_summary_rows(record)
    if not rows:
        return ""
    slos = sorted({r["slo"] for r in rows})
    lines = [f"SLO `{'`, `'.join(slos)}`: the highest request rate meeting it, per input length", "",
             "| " + " | ".join(h for _, h in _SUMMARY_COLS) + " |", "|" + "---|" * len(_SUMMARY_COLS)]
    for r in rows:
        cells = []
        for k, _ in _SUMMARY_COLS:
            v = r.get(k)
            if k == "max_rate" and v is None:
                cells.append("none passed")
            else:
                cells.append("" if v is None else _fmt(as_float(v) if k.endswith("rate") else v, 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def search_summary_csv(record: dict) -> str:
    rows = search_summary_rows(record)
    out = io.StringIO()
    if rows:
        w = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v, 4) if isinstance(v, float) else ("" if v is None else v) for k, v in r.items()})
    return out.getvalue()


def to_markdown(record: dict) -> str:
    rows = run_rows(record)
    cols = [(k, h) for k, h in _MD_COLS if any(k in r and r[k] is not None for r in rows)]
    lines = [f"# pdserve bench {record.get('kind', '')}: {record.get('date', '')}", "",
             f"`{record.get('command', '')}` (commit {record.get('git_commit') or 'unknown'})", ""]
    if record.get("searches"):
        lines += [search_summary_markdown(record), "## Trials", ""]
        for s in record["searches"]:
            lines.append(search_summary_line(s))
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

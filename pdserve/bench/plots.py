"""PNG plots from result files: latency percentiles against rate, and throughput against latency.

Any number of result files can be drawn together (each one a series per input length), which is how two
deployments are compared, e.g. colocated against disaggregated. matplotlib runs on the Agg backend so no
display is needed.
"""

from __future__ import annotations

import math
from pathlib import Path

from pdserve.bench.record import as_float
from pdserve.bench.report import search_summary_rows

_STATS = (("median", "p50", "-"), ("p90", "p90", "--"), ("p99", "p99", ":"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _failed_runs(record: dict) -> set[int]:
    return {t["run_index"] for s in record.get("searches", []) for t in s["trials"] if t.get("passed") is False}


def _series(label: str, record: dict) -> dict[str, list[tuple[float, dict]]]:
    """Runs grouped per input length, each as (x rate, metrics) sorted by rate; inf rates use the achieved rate.

    Metrics dicts of search trials that failed the SLO carry "_slo_failed" (their latencies are over the
    requests that finished, so the plot marks them rather than let them look good).
    """
    groups: dict[str, list[tuple[float, dict]]] = {}
    multi = len({r["config"].get("random_input_len") for r in record["runs"]}) > 1
    failed = _failed_runs(record)
    for i, run in enumerate(record["runs"]):
        m = run["metrics"]
        if not m.get("completed"):
            continue
        rate = as_float(run["config"].get("request_rate"))
        x = rate if math.isfinite(rate) else as_float(m["request_throughput"])
        key = f"{label} in={run['config'].get('random_input_len')}" if multi else label
        groups.setdefault(key, []).append((x, {**m, "_slo_failed": i in failed}))
    for pts in groups.values():
        pts.sort(key=lambda p: p[0])
    return groups


def _slo_limits(record: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in record.get("searches", []):
        for term in s.get("slo_terms", []):
            out[f"{term['stat']}_{term['metric']}"] = term["limit_ms"]
    return out


def plot_latency_vs_rate(sources: list[tuple[str, dict]], path: str | Path) -> Path:
    """TTFT and TPOT percentiles (p50, p90, p99) against request rate, one colour per series."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ci = 0
    for label, record in sources:
        for key, pts in _series(label, record).items():
            color = colors[ci % len(colors)]
            ci += 1
            xs = [p[0] for p in pts]
            for ax, metric in zip(axes, ("ttft", "tpot")):
                for stat, name, style in _STATS:
                    ys = [as_float(p[1].get(f"{stat}_{metric}_ms")) for p in pts]
                    ax.plot(xs, ys, linestyle=style, marker="o", ms=3, color=color, label=f"{key} {name}")
                bad = [(x, as_float(p[1].get(f"p90_{metric}_ms"))) for x, p in zip(xs, pts) if p[1]["_slo_failed"]]
                if bad:
                    ax.scatter(*zip(*bad), marker="x", s=60, color="red", zorder=5,
                               label="trial failed the SLO (p90 over finished requests)")
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for name, limit in _slo_limits(record).items():
                if name.endswith(metric):
                    ax.axhline(limit, color="red", linewidth=0.8, alpha=0.6)
                    ax.annotate(f"SLO {name} {limit:g} ms", (0.01, limit), xycoords=("axes fraction", "data"),
                                color="red", fontsize=7, va="bottom")
    for ax, title in zip(axes, ("TTFT", "TPOT (excl. 1st token)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} percentiles against request rate")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_throughput_vs_latency(sources: list[tuple[str, dict]], path: str | Path) -> Path:
    """Output token throughput against p90 TTFT and p90 TPOT as the rate rises: each deployment's trade-off."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, record in sources:
        for key, pts in _series(label, record).items():
            ys = [as_float(p[1]["output_throughput"]) for p in pts]
            for ax, metric in zip(axes, ("ttft", "tpot")):
                xs = [as_float(p[1].get(f"p90_{metric}_ms")) for p in pts]
                ax.plot(xs, ys, marker="o", ms=3, label=key)
    for ax, title in zip(axes, ("p90 TTFT (ms)", "p90 TPOT (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_title(f"throughput against {title.split(' (')[0]}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_max_rate_vs_input_len(sources: list[tuple[str, dict]], path: str | Path) -> Path:
    """Per input length: the highest rate meeting the SLO (a bar up to the lowest failing rate shows the
    search's bracket), and the output token throughput at that rate."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    slos = set()
    for label, record in sources:
        rows = [r for r in search_summary_rows(record) if r["input_len"] is not None]
        rows.sort(key=lambda r: r["input_len"])
        slos |= {r["slo"] for r in rows}
        xs = [r["input_len"] for r in rows]
        best = [as_float(r["max_rate"]) if r["max_rate"] is not None else 0.0 for r in rows]
        line = axes[0].plot(xs, best, marker="o", label=label)[0]
        fails = [as_float(r["min_failed_rate"]) for r in rows]
        for x, lo, hi in zip(xs, best, fails):
            if math.isfinite(hi):
                axes[0].plot([x, x], [lo, hi], color=line.get_color(), alpha=0.35, linewidth=4)
        axes[1].plot(xs, [as_float(r["output_throughput"]) for r in rows], marker="o", color=line.get_color(),
                     label=f"{label}")
    for ax, ylabel in zip(axes, ("request rate (req/s)", "output throughput (tok/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("highest rate meeting " + "; ".join(sorted(slos)) + " (bar: up to the lowest failing rate)",
                      fontsize=8)
    axes[1].set_title("throughput at that rate", fontsize=9)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(sources: list[tuple[str, dict]], stem: str | Path) -> list[Path]:
    stem = str(stem)
    out = [
        plot_latency_vs_rate(sources, stem + "_latency_vs_rate.png"),
        plot_throughput_vs_latency(sources, stem + "_throughput_vs_latency.png"),
    ]
    if any(s.get("input_len") is not None for _, rec in sources for s in rec.get("searches", [])):
        out.append(plot_max_rate_vs_input_len(sources, stem + "_max_rate.png"))
    return out

"""Shrink a `bench serve --save-detailed` result file (vLLM's or pdserve's client) in place: keep the summary and the
per-request start times, TTFTs, latencies and token counts, and replace the inter-token gaps and generated texts
(10+ MB at 512 requests of 1024 tokens) by each request's chunk count and its long gaps. What is left tells how each
client spread its requests over time, where each one's TTFT went, and when the slow chunks came, which the summary's
means and percentiles cannot.

Long gaps: those of at least LONG_OVER_MEDIAN times the run's median gap, each as [chunk index, ms from the request's
first chunk to the gap's end, gap ms] under "long_gaps" (one list a request); the run's median gap under
"median_gap_ms". With each request's start time and TTFT, a long gap's place in the run's wall time follows, to set
beside a server's log (e.g. pdserve's stats line).

  python benchmarks/vs_vllm/compact_detail.py RESULT.json [...]
"""

from __future__ import annotations

import json
import statistics
import sys

LONG_OVER_MEDIAN = 1.5


def long_gaps(itls: list[list[float] | None]) -> tuple[float, list[list[list[float]]]]:
    """The run's median gap (ms) and each request's gaps of at least LONG_OVER_MEDIAN times it, as
    [index, ms since the first chunk at the gap's end, gap ms]; gaps in the input are in seconds."""
    every = [g for x in itls if x for g in x]
    median = statistics.median(every) * 1e3 if every else 0.0
    out: list[list[list[float]]] = []
    for x in itls:
        kept, t = [], 0.0
        for i, g in enumerate(x or []):
            t += g * 1e3
            if every and g * 1e3 >= LONG_OVER_MEDIAN * median:
                kept.append([i, round(t, 1), round(g * 1e3, 2)])
        out.append(kept)
    return median, out


def compact(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    if "itls" in d:
        itls = d.pop("itls")
        d["chunks"] = [len(x) + 1 if x is not None else 0 for x in itls]
        d["median_gap_ms"], d["long_gaps"] = long_gaps(itls)
    d.pop("generated_texts", None)
    if "errors" in d:
        d["errors"] = [e[:200] if e else "" for e in d["errors"]]
    with open(path, "w") as f:
        json.dump(d, f)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        compact(p)

"""Shrink a `bench serve --save-detailed` result file (vLLM's or pdserve's client) in place: keep the summary and the
per-request start times, TTFTs, latencies and token counts, and replace the inter-token gaps and generated texts
(10+ MB at 512 requests of 1024 tokens) by each request's chunk count. What is left tells how each client spread
its requests over time and where each one's TTFT went, which the summary's means cannot.

  python benchmarks/vs_vllm/compact_detail.py RESULT.json [...]
"""

from __future__ import annotations

import json
import sys


def compact(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    if "itls" in d:
        d["chunks"] = [len(x) + 1 if x is not None else 0 for x in d.pop("itls")]
    d.pop("generated_texts", None)
    if "errors" in d:
        d["errors"] = [e[:200] if e else "" for e in d["errors"]]
    with open(path, "w") as f:
        json.dump(d, f)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        compact(p)

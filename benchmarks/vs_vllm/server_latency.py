"""What a server measured of one benchmark run itself: its Prometheus /metrics scraped before and after the run,
each latency histogram's count and mean taken over the difference.

Why: vLLM's server may send several tokens in a request's first chunk (session 31: 13.75 of 16 at 32k prompts, one
at a time), so vLLM's client sees a late first token and then a burst, and its TPOT, (E2EL - TTFT) / (tokens - 1),
falls below the time a decode step takes. A server's own histograms time each token where it is made: vLLM's
engine-core timestamps (`vllm:inter_token_latency_seconds` a step, `vllm:request_time_per_output_token_seconds` a
request), pdserve's output deltas as its HTTP server takes them (`pdserve:inter_token_latency_seconds`). Over a run
whose requests all generate the same number of tokens (--ignore-eos), the mean inter-token latency equals the mean of
the requests' TPOTs (each request adds tokens - 1 gaps that sum to its last token's time less its first's).

Where the clocks start: vLLM's at its renderer's arrival_time, stamped before it tokenizes the prompt; pdserve's once
the request's body is read, before it tokenizes (until session 37 after it, so its server TTFT and E2E then left out
a long prompt's tokenization, tens of ms at 32k tokens, which vLLM's held).

The difference counts every request between the scrapes, the client's warm-up requests too (`requests` says how
many finished).

  python benchmarks/vs_vllm/server_latency.py BEFORE.txt AFTER.txt OUT.json
"""

from __future__ import annotations

import json
import sys

from prometheus_client.parser import text_string_to_metric_families

# histogram family name -> the field it fills
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:request_time_per_output_token_seconds": "tpot",
    "vllm:e2e_request_latency_seconds": "e2el",
    "pdserve:time_to_first_token_seconds": "ttft",
    "pdserve:inter_token_latency_seconds": "itl",
    "pdserve:e2e_request_latency_seconds": "e2el",
}


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """Each known histogram's (count, sum) over all its label sets (vLLM labels by engine and model); none from a
    body that is not Prometheus text (a proxy in front of the servers answers /metrics with a 404 page)."""
    out: dict[str, tuple[float, float]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return out
    for fam in families:
        if fam.type != "histogram" or fam.name not in HISTOGRAMS:
            continue
        count = sum(s.value for s in fam.samples if s.name == fam.name + "_count")
        total = sum(s.value for s in fam.samples if s.name == fam.name + "_sum")
        out[fam.name] = (count, total)
    return out


def run_latency(before: str, after: str) -> dict:
    """{field: {"count": n, "mean_ms": m}} for each histogram that grew between the two scrapes, and "requests": how
    many requests finished between them (the e2e histogram's count), or None if the server has none."""
    a, b = histogram_totals(before), histogram_totals(after)
    out: dict = {}
    for name, (count, total) in b.items():
        c0, s0 = a.get(name, (0.0, 0.0))
        n = count - c0
        if n > 0:
            out[HISTOGRAMS[name]] = {"metric": name, "count": int(n), "mean_ms": (total - s0) / n * 1e3}
    out["requests"] = out["e2el"]["count"] if "e2el" in out else None
    return out


def line(d: dict) -> str:
    parts = [f"{k} {v['mean_ms']:.2f} ms (n={v['count']})" for k, v in d.items() if isinstance(v, dict)]
    return "server-side means: " + (", ".join(parts) if parts else "none (no latency histograms grew)")


def main(argv: list[str]) -> None:
    before, after, out = argv
    texts = []
    for p in (before, after):
        with open(p, errors="replace") as f:
            texts.append(f.read())
    d = run_latency(*texts)
    with open(out, "w") as f:
        json.dump(d, f)
    print(line(d))


if __name__ == "__main__":
    main(sys.argv[1:])

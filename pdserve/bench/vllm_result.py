"""vLLM 0.22 `bench serve`'s outputs, reproduced: the flat result JSON, its file name, and the console block.

Tools that read vLLM's result files (dashboards, comparison scripts) read pdserve's: the same keys in the same
order with the same meanings, per-request lists kept only with --save-detailed (except `latencies` and
`queue_times`, which vLLM always keeps), --append-result writing one JSON document per line, and vLLM's file
name `{label or backend}-{request_rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.client import RequestResult
from pdserve.bench.metrics import pct_name

# (key, console name, section header) in vLLM's order
METRIC_TITLES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("client_queue_time", "Client Queue Time", "Client-side Queueing"),
    ("e2el_including_client_queue", "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
)
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


@dataclass
class RunInfo:
    """What vLLM's result file records about a run besides the measurements."""

    backend: str = "openai"
    label: str | None = None
    model_id: str = ""
    tokenizer_id: str | None = None
    num_prompts: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    date: str = ""  # local time, "%Y%m%d-%H%M%S"
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: bool = False


def reported_metrics(info: RunInfo) -> list[tuple[str, str, str]]:
    """The percentile sections vLLM prints and saves: those selected, queue ones only under a concurrency cap
    (the queue-inclusive E2EL only with a finite rate too)."""
    out = []
    for key, name, header in METRIC_TITLES:
        if key not in info.percentile_metrics:
            continue
        if key == "client_queue_time" and info.max_concurrency is None:
            continue
        if key == "e2el_including_client_queue" and (info.max_concurrency is None or math.isinf(info.request_rate)):
            continue
        out.append((key, name, header))
    return out


def result_dict(results: list[RequestResult], metrics: dict, info: RunInfo, save_detailed: bool = False) -> dict:
    """vLLM's result JSON of one run, from its requests (in send order) and `compute_metrics`' summary."""
    d: dict = {"date": info.date, "endpoint_type": info.backend, "backend": info.backend, "label": info.label,
               "model_id": info.model_id, "tokenizer_id": info.tokenizer_id, "num_prompts": info.num_prompts}
    d.update(info.metadata)
    d["request_rate"] = info.request_rate if math.isfinite(info.request_rate) else "inf"
    d["burstiness"] = info.burstiness
    d["max_concurrency"] = info.max_concurrency
    d.update({
        "duration": metrics["duration"],
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "total_input_tokens": metrics["total_input_tokens"],
        "total_output_tokens": metrics["total_output_tokens"],
        "request_throughput": metrics["request_throughput"],
        "request_goodput": metrics["request_goodput"] if info.goodput else None,
        "output_throughput": metrics["output_throughput"],
        "total_token_throughput": metrics["total_token_throughput"],
        "input_lens": [r.input_tokens if r.success else max(r.prompt_len, 0) for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],  # vLLM leaves both at 0 for a failed request
        "itls": [list(r.itl) for r in results],
        "latencies": [r.latency if r.success else 0.0 for r in results],
        "start_times": [r.start for r in results],
        "queue_times": [r.queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": metrics["max_output_tokens_per_s"],
        "max_concurrent_requests": metrics["max_concurrent_requests"],
        "rtfx": 0.0,
    })
    for key, _, _ in reported_metrics(info):
        for stat in ("mean", "median", "std"):
            d[f"{stat}_{key}_ms"] = metrics[f"{stat}_{key}_ms"]
        for p in info.metric_percentiles:
            d[f"p{pct_name(p)}_{key}_ms"] = metrics[f"p{pct_name(p)}_{key}_ms"]
    if not save_detailed:
        for k in DETAILED_KEYS:
            d.pop(k, None)
    return d


def default_filename(info: RunInfo) -> str:
    """vLLM's file name when --result-filename is not given (request_rate as Python prints a float)."""
    conc = f"-concurrency{info.max_concurrency}" if info.max_concurrency is not None else ""
    base_model = info.model_id.split("/")[-1]
    return f"{info.label or info.backend}-{float(info.request_rate)}qps{conc}-{base_model}-{info.date}.json"


def write_result(result: dict, path: str | Path, append: bool = False) -> Path:
    """Write (or with `append`, add a line to) vLLM's result file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+" if append else "w", encoding="utf-8") as f:
        if append and f.tell() != 0:
            f.write("\n")
        json.dump(result, f)
    return path


def console_block(metrics: dict, info: RunInfo) -> str:
    """The "Serving Benchmark Result" block vLLM prints, line for line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def put(label: str, value, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{fmt}}".format(label, value, fmt=fmt))

    put("Successful requests:", metrics["completed"])
    put("Failed requests:", metrics["failed"])
    if info.max_concurrency is not None:
        put("Maximum request concurrency:", info.max_concurrency)
    if math.isfinite(info.request_rate):
        put("Request rate configured (RPS):", info.request_rate, ".2f")
    put("Benchmark duration (s):", metrics["duration"], ".2f")
    put("Total input tokens:", metrics["total_input_tokens"])
    put("Total generated tokens:", metrics["total_output_tokens"])
    put("Request throughput (req/s):", metrics["request_throughput"], ".2f")
    if info.goodput:
        put("Request goodput (req/s):", metrics["request_goodput"], ".2f")
    put("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    put("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"], ".2f")
    put("Peak concurrent requests:", metrics["max_concurrent_requests"], ".2f")
    put("Total token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    for key, name, header in reported_metrics(info):
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        put(f"Mean {name} (ms):", metrics[f"mean_{key}_ms"], ".2f")
        put(f"Median {name} (ms):", metrics[f"median_{key}_ms"], ".2f")
        for p in info.metric_percentiles:
            put(f"P{pct_name(p)} {name} (ms):", metrics[f"p{pct_name(p)}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines) + "\n"


def failed_requests_note(results: list[RequestResult]) -> str:
    """vLLM's listing of (at most 10) failed requests, printed before the block."""
    failed = [r for r in results if not r.success]
    if not failed:
        return ""
    out = ["Failed requests during benchmark run detected (capping to 10):"]
    out += [f"Error {i}: {r.error}" for i, r in enumerate(failed[:10])]
    return "\n".join(out) + "\n"

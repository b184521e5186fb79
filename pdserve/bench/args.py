"""Command-line flags of `pdserve bench`, and their translation into the configuration dataclasses.

Flags shared with vLLM 0.22's `bench serve` keep its names, defaults and meanings, so a `vllm bench serve`
command line runs unchanged (the flags vLLM has for other backends, multimodal or LoRA datasets are not here).
pdserve's own flags (SLO search, drain timeout, client capacity, ...) sit beside them. Every command writes its
files under --result-dir, named by --result-filename.
"""

from __future__ import annotations

import argparse
import json
import math
import uuid
from dataclasses import replace

from pdserve.bench.client import BACKENDS, CHAT_ENDPOINT, EndpointConfig
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.metrics import ALL_METRICS, MetricOptions
from pdserve.bench.paths import add_output_flags
from pdserve.bench.runner import DATASETS, WorkloadConfig
from pdserve.bench.search import SearchConfig
from pdserve.bench.slo import goodput_limits
from pdserve.envs import openai_api_key

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")


def positive_rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return v


def float_list(text: str) -> list[float]:
    return [positive_rate(x) for x in text.split(",") if x.strip()]


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """KEY=VALUE items (vLLM's --metadata and --header) as a dict; the value may contain '='."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def add_common(p: argparse.ArgumentParser, rate: bool = True, input_len_list: bool = False) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="openai and vllm: /v1/completions; openai-chat: /v1/chat/completions")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    g.add_argument("--header", nargs="*", metavar="KEY=VALUE", default=None, help="extra HTTP headers")
    g.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    g.add_argument("--served-model-name", default=None, help="model name sent in requests (default: --model)")
    g.add_argument("--tokenizer", default=None,
                   help="HF directory, tokenizer.json or .gguf (default: --model when it names one)")
    g.add_argument("--api-key", default=openai_api_key(), help="Bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds allowed per request")
    g.add_argument("--trust-env", action=argparse.BooleanOptionalAction, default=EndpointConfig.trust_env,
                   help="honour HTTP(S)_PROXY/NO_PROXY and .netrc per request, as vLLM's bench serve does (default); "
                        "--no-trust-env skips aiohttp's two per-request lookups, whose thread-pool round trips add "
                        "2-5 ms to each TTFT under load and ~200 ms to a burst of 256 (lease_s11, lease_s18)")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="retry the initial test request for up to this many seconds while the server starts")
    g.add_argument("--skip-initial-test", action="store_true", help="send no test request before the run")
    g.add_argument("--num-warmups", type=int, default=0, help="warm-up requests before the measured run")
    g.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                   help="request i is sent with x-request-id: <prefix><i>")
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly the output length (always on for --dataset-name random)")
    g.add_argument("--logprobs", type=int, default=None, help="logprobs per token to ask for (completions)")
    g = p.add_argument_group("sampling (sent only when given; the server's defaults otherwise)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g = p.add_argument_group("workload")
    lens = int_list if input_len_list else int
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or prompt file (JSONL or text lines)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", type=lens, default=None, help="sets --random-input-len")
    g.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    g.add_argument("--random-input-len", type=lens, default=[1024] if input_len_list else 1024,
                   help="prompt tokens as the server counts them" + (" (comma-separated: one search each)"
                                                                       if input_len_list else ""))
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--file-output-len", type=int, default=256)
    g.add_argument("--multi-round-users", type=int, default=8)
    g.add_argument("--multi-round-rounds", type=int, default=4)
    g.add_argument("--multi-round-system-len", type=int, default=1000, help="shared system prompt tokens")
    g.add_argument("--multi-round-history-len", type=int, default=1000, help="per-user history tokens")
    g.add_argument("--multi-round-question-len", type=int, default=100, help="tokens per question")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    if rate:
        g.add_argument("--request-rate", type=positive_rate, default=math.inf, help="requests/s, or inf (default)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson, inf = regular")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--drain-timeout", type=float, default=None,
                   help="after the last arrival, wait at most this long for requests in flight")
    g = p.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--percentile-metrics", default=None,
                   help=f"comma-separated, from {','.join(ALL_METRICS)} (default ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", default="99", help='comma-separated, e.g. "50,90,99"')
    add_output_flags(g, "vLLM's pattern" if rate else "<command>-<model>-<date>.json")
    g.add_argument("--save-result", action="store_true", help="write the result files")
    g.add_argument("--save-detailed", action="store_true",
                   help="keep per-request lists (ttfts, itls, texts, errors, ...) in vLLM's result file")
    g.add_argument("--append-result", action="store_true", help="append to vLLM's result file (one JSON a line)")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None, help="added to vLLM's result file")
    g.add_argument("--label", default=None, help="prefix of the default file name (default: --backend)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--capacity-duration", type=float, default=2.0,
                   help="seconds spent measuring the client's capacity (0: skip)")


def add_search(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("SLO search")
    g.add_argument("--slo", required=required, default=None, help='e.g. "p90_ttft_ms<=5000,p90_tpot_ms<=50"')
    g.add_argument("--start-rate", type=positive_rate, default=1.0)
    g.add_argument("--max-rate", type=positive_rate, default=1024.0)
    g.add_argument("--min-rate", type=positive_rate, default=0.05)
    g.add_argument("--growth", type=float, default=2.0)
    g.add_argument("--tolerance", type=float, default=0.1, help="stop when the bracket is within this fraction")
    g.add_argument("--max-trials", type=int, default=24, help="per input length")
    g.add_argument("--requests-per-rate", type=float, default=5.0, help="a trial sends at least this x rate requests")
    g.add_argument("--min-duration", type=float, default=0.0, help="a trial's arrivals span at least this long (s)")
    g.add_argument("--min-requests", type=int, default=10)
    g.add_argument("--max-requests", type=int, default=None, help="cap on requests per trial")
    g.add_argument("--max-duration", type=float, default=None, help="cap on a trial's arrival window (s)")
    g.add_argument("--time-budget", type=float, default=None, help="seconds for each input length's search")
    g.add_argument("--cooldown", type=float, default=2.0, help="idle seconds between trials")
    g.add_argument("--no-early-stop", action="store_true", help="run failing trials to the end")


# ---------------------------------------------------------------------------------------------------------


def endpoint_config(args) -> EndpointConfig:
    base = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or BACKENDS[args.backend]
    if args.backend == "openai-chat" and endpoint != CHAT_ENDPOINT:
        raise ValueError(f"--backend openai-chat needs --endpoint {CHAT_ENDPOINT}, got {endpoint}")
    sampling = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    return EndpointConfig(base_url=base, endpoint=endpoint, model=args.served_model_name or args.model or "",
                          ignore_eos=args.ignore_eos or args.dataset_name == "random", sampling=sampling,
                          extra_body=args.extra_body or {}, headers=key_values(args.header, "--header"),
                          logprobs=args.logprobs, request_timeout_s=args.request_timeout, api_key=args.api_key,
                          trust_env=args.trust_env)


def workload_config(args, input_len: int | None = None) -> WorkloadConfig:
    out_len = args.output_len
    w = WorkloadConfig(
        dataset_name=args.dataset_name, dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len if isinstance(args.random_input_len, int) else args.random_input_len[0],
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, sharegpt_output_len=args.sharegpt_output_len,
        file_output_len=args.file_output_len, multi_round_users=args.multi_round_users,
        multi_round_rounds=args.multi_round_rounds, multi_round_system_len=args.multi_round_system_len,
        multi_round_history_len=args.multi_round_history_len,
        multi_round_question_len=args.multi_round_question_len, seed=args.seed,
    )
    if out_len is not None:  # vLLM's --output-len sets every dataset's output length
        w = replace(w, random_output_len=out_len, sharegpt_output_len=out_len, file_output_len=out_len)
    if input_len is not None:
        w = replace(w, random_input_len=input_len)
    return w


def input_lens(args) -> list[int]:
    """The input lengths asked for: --input-len over --random-input-len, a list where the command takes one."""
    v = args.input_len if args.input_len is not None else args.random_input_len
    return list(v) if isinstance(v, list) else [v]


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """vLLM's --goodput KEY:MS pairs, KEY one of ttft, tpot, e2el, MS non-negative."""
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if not sep or key not in ("ttft", "tpot", "e2el") or not value >= 0:
            raise ValueError(f"--goodput: bad item {item!r}, expected ttft:MS, tpot:MS or e2el:MS (MS >= 0)")
        out[key] = value
    return out


def metric_options(args, slo_terms=None) -> MetricOptions:
    pm = tuple(x.strip() for x in (args.percentile_metrics or "ttft,tpot,itl").split(",") if x.strip())
    bad = [x for x in pm if x not in ALL_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(ALL_METRICS)}")
    try:
        pcts = tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected numbers, got {args.metric_percentiles!r}") from None
    if any(not 0 <= p <= 100 for p in pcts):
        raise ValueError(f"--metric-percentiles must be within [0, 100], got {args.metric_percentiles!r}")
    goodput = parse_goodput(args.goodput)
    if goodput is None and slo_terms:
        goodput = goodput_limits(slo_terms) or None
    return MetricOptions(percentile_metrics=pm, metric_percentiles=pcts, goodput_ms=goodput)


def load_config(args, rate: float = math.inf, max_duration: float | None = None) -> LoadConfig:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    return LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      seed=args.seed, max_duration_s=max_duration, drain_timeout_s=args.drain_timeout,
                      progress=not args.disable_tqdm, request_id_prefix=args.request_id_prefix)


def search_config(args) -> SearchConfig:
    return SearchConfig(start_rate=args.start_rate, growth=args.growth, max_rate=args.max_rate, min_rate=args.min_rate,
                        tolerance=args.tolerance, max_trials=args.max_trials, requests_per_rate=args.requests_per_rate,
                        min_duration_s=args.min_duration, min_requests=args.min_requests,
                        max_requests=args.max_requests, max_duration_s=args.max_duration,
                        time_budget_s=args.time_budget, cooldown_s=args.cooldown)

"""`pdserve bench serve | search | sweep | compare | plot`: argument parsing and the commands.

Flag names and meanings follow vLLM's `bench serve` where they overlap, so results compare. Each command
returns an exit code: 0 done, 1 benchmark error (message printed), 2 bad arguments, 130 interrupted (what
was measured is still printed and written).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import math
import signal
import sys
import time
from pathlib import Path

from pdserve.bench.client import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EndpointConfig
from pdserve.bench.loadgen import LoadConfig, StopSignal
from pdserve.bench.metrics import METRICS, MetricOptions
from pdserve.bench.record import load_json, new_record, save_json
from pdserve.bench.report import console_summary, search_table, to_csv, to_markdown
from pdserve.bench.runner import DATASETS, Bench, BenchError, WorkloadConfig, strip_live
from pdserve.bench.search import SearchConfig
from pdserve.bench.slo import goodput_limits, parse_slo
from pdserve.bench.tokenizer import load_tokenizer
from pdserve.envs import openai_api_key


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return v


def _float_list(text: str) -> list[float]:
    return [_rate(x) for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_common(p: argparse.ArgumentParser, rate: bool = True) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=COMPLETIONS_ENDPOINT, choices=[COMPLETIONS_ENDPOINT, CHAT_ENDPOINT])
    g.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    g.add_argument("--tokenizer", default=None,
                   help="HF directory, tokenizer.json or .gguf (default: --model when it names one)")
    g.add_argument("--api-key", default=openai_api_key())
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly the output length")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds allowed per request")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or prompt file (JSONL or text lines)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
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
        g.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, or inf (default)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--drain-timeout", type=float, default=None,
                   help="after the last arrival, wait at most this long for requests in flight")
    g = p.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    g.add_argument("--metric-percentiles", default="99")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None, help="file stem (default: <kind>-<model>-<date>)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--capacity-duration", type=float, default=2.0,
                   help="seconds spent measuring the client's capacity (0: skip)")
    g.add_argument("--skip-initial-test", action="store_true")


def _add_search(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("SLO search")
    g.add_argument("--slo", required=required, default=None, help='e.g. "p90_ttft_ms<=5000,p90_tpot_ms<=50"')
    g.add_argument("--start-rate", type=_rate, default=1.0)
    g.add_argument("--max-rate", type=_rate, default=1024.0)
    g.add_argument("--min-rate", type=_rate, default=0.05)
    g.add_argument("--growth", type=float, default=2.0)
    g.add_argument("--tolerance", type=float, default=0.1, help="stop when the bracket is within this fraction")
    g.add_argument("--max-trials", type=int, default=24)
    g.add_argument("--requests-per-rate", type=float, default=5.0, help="a trial sends at least this x rate requests")
    g.add_argument("--min-duration", type=float, default=0.0, help="a trial's arrivals span at least this long (s)")
    g.add_argument("--min-requests", type=int, default=10)
    g.add_argument("--max-requests", type=int, default=None, help="cap on requests per trial")
    g.add_argument("--max-duration", type=float, default=None, help="cap on a trial's arrival window (s)")
    g.add_argument("--time-budget", type=float, default=None, help="seconds for the whole search")
    g.add_argument("--cooldown", type=float, default=2.0, help="idle seconds between trials")
    g.add_argument("--no-early-stop", action="store_true", help="run failing trials to the end")


def add_subcommands(subparsers) -> None:
    """Add serve, search, sweep, compare and plot to an argparse subparsers object (pdserve's `bench`)."""
    p = subparsers.add_parser("serve", help="benchmark an OpenAI-compatible endpoint at one request rate")
    _add_common(p)
    p.add_argument("--max-duration", type=float, default=None, help="no arrivals after this many seconds")
    p.add_argument("--save-result", action="store_true", help="write JSON, CSV and markdown results")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("search", help="find the highest request rate meeting an SLO")
    _add_common(p, rate=False)
    _add_search(p, required=True)
    p.set_defaults(func=cmd_search)

    p = subparsers.add_parser("sweep", help="input lengths x request rates (or an SLO search per input length)")
    _add_common(p, rate=False)
    _add_search(p, required=False)
    p.add_argument("--input-lens", type=_int_list, required=True, help="e.g. 128,1024,4096")
    p.add_argument("--request-rates", type=_float_list, default=None, help="e.g. 1,2,4,inf (without --slo)")
    p.set_defaults(func=cmd_sweep)

    p = subparsers.add_parser("compare", help="plot and tabulate result files side by side")
    p.add_argument("results", nargs="+", help="result JSON files")
    p.add_argument("--labels", default=None, help="comma-separated series names (default: file names)")
    p.add_argument("--output", required=True, help="output stem: writes <stem>_*.png and <stem>.md")
    p.set_defaults(func=cmd_compare)

    p = subparsers.add_parser("plot", help="draw the plots of one result file")
    p.add_argument("result")
    p.add_argument("--output", default=None, help="output stem (default: next to the JSON)")
    p.set_defaults(func=cmd_plot)


# ---------------------------------------------------------------------------------------------------------


def _endpoint(args) -> EndpointConfig:
    base = args.base_url or f"http://{args.host}:{args.port}"
    return EndpointConfig(base_url=base, endpoint=args.endpoint, model=args.model or "", ignore_eos=args.ignore_eos,
                          temperature=args.temperature, extra_body=args.extra_body,
                          request_timeout_s=args.request_timeout, api_key=args.api_key)


def _workload(args) -> WorkloadConfig:
    return WorkloadConfig(
        dataset_name=args.dataset_name, dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len, file_output_len=args.file_output_len,
        multi_round_users=args.multi_round_users, multi_round_rounds=args.multi_round_rounds,
        multi_round_system_len=args.multi_round_system_len, multi_round_history_len=args.multi_round_history_len,
        multi_round_question_len=args.multi_round_question_len, seed=args.seed,
    )


def _metric_opts(args, slo_terms=None) -> MetricOptions:
    pm = tuple(x.strip() for x in args.percentile_metrics.split(",") if x.strip())
    bad = [x for x in pm if x not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
    pcts = tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip())
    goodput = None
    if args.goodput:
        goodput = {}
        for item in args.goodput:
            key, _, ms = item.partition(":")
            if key not in ("ttft", "tpot", "e2el") or not ms:
                raise ValueError(f"--goodput: bad item {item!r}, expected ttft:MS, tpot:MS or e2el:MS")
            goodput[key] = float(ms)
    elif slo_terms:
        goodput = goodput_limits(slo_terms) or None
    return MetricOptions(percentile_metrics=pm, metric_percentiles=pcts, goodput_ms=goodput)


def _load(args, rate: float = math.inf) -> LoadConfig:
    return LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      seed=args.seed, max_duration_s=getattr(args, "max_duration", None),
                      drain_timeout_s=args.drain_timeout, progress=not args.disable_tqdm)


def _search_cfg(args) -> SearchConfig:
    return SearchConfig(start_rate=args.start_rate, growth=args.growth, max_rate=args.max_rate, min_rate=args.min_rate,
                        tolerance=args.tolerance, max_trials=args.max_trials, requests_per_rate=args.requests_per_rate,
                        min_duration_s=args.min_duration, min_requests=args.min_requests,
                        max_requests=args.max_requests, max_duration_s=args.max_duration,
                        time_budget_s=args.time_budget, cooldown_s=args.cooldown)


def _open_bench(args, endpoint: EndpointConfig, opts: MetricOptions) -> Bench:
    return Bench(endpoint, tok=None, metric_opts=opts, capacity_duration_s=args.capacity_duration,
                 initial_test=not args.skip_initial_test)


def _attach_tokenizer(bench: Bench, args) -> None:
    name = args.tokenizer or bench.endpoint.model
    try:
        bench.tok = load_tokenizer(name)
    except ValueError as e:
        if args.tokenizer or args.dataset_name in ("random", "multi-round"):
            raise BenchError(str(e)) from None
        print(f"note: no tokenizer ({e}); token counts come from the server's usage", file=sys.stderr)


def _stem(args, record: dict, model: str) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        name = f"{record['kind']}-{Path(model).name or 'model'}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(args.result_dir or ".") / name


def write_outputs(record: dict, stem: Path, plots: bool) -> list[Path]:
    """The JSON record, a CSV of runs, a markdown table and (with at least two runs) the PNG plots."""
    paths = [save_json(record, stem.with_suffix(".json"))]
    stem.with_suffix(".csv").write_text(to_csv(record))
    stem.with_suffix(".md").write_text(to_markdown(record))
    paths += [stem.with_suffix(".csv"), stem.with_suffix(".md")]
    if plots and sum(1 for r in record["runs"] if r["metrics"].get("completed")) >= 1:
        if importlib.util.find_spec("matplotlib") is None:  # e.g. a GPU image without it: plot elsewhere later
            print(f"note: matplotlib is not installed, no plots; run `python -m pdserve.bench plot "
                  f"{stem.with_suffix('.json')}` where it is", file=sys.stderr)
            return paths
        from pdserve.bench.plots import write_plots

        paths += write_plots([(record["runs"][0]["config"].get("model") or "run", record)], str(stem))
    return paths


def _run_async(fn, args) -> int:
    """Run a command with Ctrl-C turned into a graceful stop (a second Ctrl-C quits at once)."""

    async def main() -> int:
        stop = StopSignal()
        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            stop.set("interrupted")
            print("\nInterrupted: finishing up and writing what was measured (Ctrl-C again to quit now)",
                  file=sys.stderr)
            loop.remove_signal_handler(signal.SIGINT)

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            pass
        return await fn(args, stop)

    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        uvloop = None
    try:  # uvloop (when installed) parses more streamed chunks per second: more client headroom
        return uvloop.run(main()) if hasattr(uvloop, "run") else asyncio.run(main())
    except (BenchError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    return _run_async(_serve, args)


async def _serve(args, stop: StopSignal) -> int:
    endpoint, opts = _endpoint(args), _metric_opts(args)
    workload, load = _workload(args), _load(args, args.request_rate)
    record = new_record("serve", _args_dict(args))
    async with _open_bench(args, endpoint, opts) as bench:
        _attach_tokenizer(bench, args)
        print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness}"
              f"{' (Poisson process)' if args.burstiness == 1.0 else ''}\n"
              f"Maximum request concurrency: {args.max_concurrency}", file=sys.stderr)
        run = await bench.run(workload, load, stop=stop, label=f"rate={args.request_rate:g}")
    record["runs"].append(strip_live(run))
    print(console_summary(run, opts.percentile_metrics, opts.metric_percentiles))
    if args.save_result or args.result_dir or args.result_filename:
        for p in write_outputs(record, _stem(args, record, endpoint.model), plots=False):
            print(f"wrote {p}")
    return 130 if run["interrupted"] else 0


def cmd_search(args) -> int:
    return _run_async(_search, args)


async def _search(args, stop: StopSignal) -> int:
    from pdserve.bench.trials import run_slo_search

    terms = parse_slo(args.slo)
    endpoint, opts, cfg = _endpoint(args), _metric_opts(args, terms), _search_cfg(args)
    record = new_record("search", _args_dict(args))
    async with _open_bench(args, endpoint, opts) as bench:
        _attach_tokenizer(bench, args)
        section = await run_slo_search(bench, _workload(args), _load(args), terms, cfg, stop, record,
                                       early_stop=not args.no_early_stop, on_trial=_print_trial)
    print(search_table(section))
    for p in write_outputs(record, _stem(args, record, endpoint.model), plots=not args.no_plots):
        print(f"wrote {p}")
    return 130 if stop.is_set else 0


def cmd_sweep(args) -> int:
    return _run_async(_sweep, args)


async def _sweep(args, stop: StopSignal) -> int:
    from dataclasses import replace

    from pdserve.bench.trials import run_slo_search

    if args.dataset_name != "random":
        raise ValueError("sweep varies --random-input-len, so it needs --dataset-name random")
    if bool(args.slo) == bool(args.request_rates):
        raise ValueError("sweep needs exactly one of --slo (a search per input length) or --request-rates")
    terms = parse_slo(args.slo) if args.slo else None
    endpoint, opts = _endpoint(args), _metric_opts(args, terms)
    record = new_record("sweep", _args_dict(args))
    async with _open_bench(args, endpoint, opts) as bench:
        _attach_tokenizer(bench, args)
        for n_in in args.input_lens:
            workload = replace(_workload(args), random_input_len=n_in)
            if terms:
                section = await run_slo_search(bench, workload, _load(args), terms, _search_cfg(args), stop,
                                               record, early_stop=not args.no_early_stop, on_trial=_print_trial)
                print(search_table(section))
            else:
                for rate in args.request_rates:
                    if stop.is_set:
                        break
                    run = await bench.run(workload, _load(args, rate), stop=stop, label=f"in={n_in} rate={rate:g}")
                    record["runs"].append(strip_live(run))
                    print(f"input {n_in}, rate {rate:g}:")
                    print(console_summary(run, opts.percentile_metrics, opts.metric_percentiles))
            if stop.is_set:
                break
    for p in write_outputs(record, _stem(args, record, endpoint.model), plots=not args.no_plots):
        print(f"wrote {p}")
    return 130 if stop.is_set else 0


def cmd_compare(args) -> int:
    from pdserve.bench.plots import write_plots

    try:
        records = [load_json(p) for p in args.results]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    labels = args.labels.split(",") if args.labels else [Path(p).stem for p in args.results]
    if len(labels) != len(records):
        print(f"error: {len(labels)} labels for {len(records)} result files", file=sys.stderr)
        return 2
    stem = Path(args.output)
    for p in write_plots(list(zip(labels, records)), str(stem)):
        print(f"wrote {p}")
    md = "\n".join(f"## {label}\n\n" + to_markdown(rec) for label, rec in zip(labels, records))
    stem.with_suffix(".md").write_text(md)
    print(f"wrote {stem.with_suffix('.md')}")
    return 0


def cmd_plot(args) -> int:
    from pdserve.bench.plots import write_plots

    try:
        record = load_json(args.result)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stem = args.output or str(Path(args.result).with_suffix(""))
    for p in write_plots([(Path(args.result).stem, record)], stem):
        print(f"wrote {p}")
    return 0


def _print_trial(t) -> None:
    verdict = {True: "pass", False: "FAIL", None: "stopped"}[t.passed]
    vals = ", ".join(f"{k}={v:.1f}" for k, v in t.values.items())
    print(f"trial rate {t.rate:.3f} req/s: {verdict} ({t.num_sent} sent) {vals} {t.reason[:100]}", file=sys.stderr)


def _args_dict(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench", description="Benchmarks for OpenAI-compatible servers")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return args.func(args)

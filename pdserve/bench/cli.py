"""`pdserve bench serve | search | sweep | compare | plot | transfer`: the commands.

`serve` is a drop-in for vLLM 0.22's `vllm bench serve`: its flags, metric definitions, console block and
result file (pdserve's fuller record is written beside it). `search` finds, for each input length given, the
highest request rate meeting an SLO. Each command returns an exit code: 0 done, 1 benchmark error (message
printed), 2 bad arguments, 130 interrupted (what was measured is still printed and written).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import importlib
import json
import math
import signal
import sys
from dataclasses import replace
from pathlib import Path

from pdserve.bench import args as flags
from pdserve.bench.loadgen import StopSignal
from pdserve.bench.metrics import MetricOptions
from pdserve.bench.outputs import write_outputs
from pdserve.bench.paths import (
    add_output_flags,
    default_name,
    output_stem,
    pdserve_record_path,
    record_path,
    result_path,
)
from pdserve.bench.record import load_json, new_record
from pdserve.bench.report import console_summary, search_summary_markdown, search_table, to_markdown
from pdserve.bench.runner import Bench, BenchError, strip_live
from pdserve.bench.slo import parse_slo
from pdserve.bench.tokenizer import load_tokenizer
from pdserve.bench.vllm_result import RunInfo, default_filename, failed_requests_note, result_dict, write_result


def add_subcommands(subparsers) -> None:
    """Add serve, search, sweep, compare, plot and transfer to an argparse subparsers object."""
    p = subparsers.add_parser("serve", help="benchmark an OpenAI-compatible endpoint at one request rate "
                                            "(vLLM bench serve's flags, metrics and result file)")
    flags.add_common(p)
    p.add_argument("--max-duration", type=float, default=None, help="no arrivals after this many seconds")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("search", help="the highest request rate meeting an SLO, for each input length")
    flags.add_common(p, rate=False, input_len_list=True)
    flags.add_search(p, required=True)
    p.set_defaults(func=cmd_search)

    p = subparsers.add_parser("sweep", help="input lengths x request rates (or an SLO search per input length)")
    flags.add_common(p, rate=False)
    flags.add_search(p, required=False)
    p.add_argument("--input-lens", type=flags.int_list, required=True, help="e.g. 128,1024,4096")
    p.add_argument("--request-rates", type=flags.float_list, default=None, help="e.g. 1,2,4,inf (without --slo)")
    p.set_defaults(func=cmd_sweep)

    p = subparsers.add_parser("compare", help="plot and tabulate result files side by side")
    p.add_argument("results", nargs="+", help="pdserve result JSON files")
    p.add_argument("--labels", default=None, help="comma-separated series names (default: file names)")
    add_output_flags(p, "compare.md: compare.md and compare_*.png", old_spelling="--output")
    p.set_defaults(func=cmd_compare)

    p = subparsers.add_parser("plot", help="draw the plots of one result file")
    p.add_argument("result")
    add_output_flags(p, "the result's own name, beside it", old_spelling="--output")
    p.set_defaults(func=cmd_plot)

    from pdserve.bench import transfer

    p = subparsers.add_parser("transfer", help="KV transfer engine benchmark between two processes")
    transfer.add_arguments(p)
    p.set_defaults(func=transfer.main)


# ---------------------------------------------------------------------------------------------------------


def _open_bench(args, opts: MetricOptions) -> Bench:
    return Bench(flags.endpoint_config(args), tok=None, metric_opts=opts, capacity_duration_s=args.capacity_duration,
                 initial_test=not args.skip_initial_test, ready_check_timeout_s=args.ready_check_timeout_sec,
                 num_warmups=args.num_warmups)


def _model_id(args, bench: Bench) -> str:
    """vLLM's model id: --model, else the root of the first model /v1/models lists, else its name."""
    return args.model or bench.model_root or bench.endpoint.model


def _attach_tokenizer(bench: Bench, args, model_id: str) -> str | None:
    """Load --tokenizer, else the model id's (then the served name's); returns the tokenizer id used."""
    names = [args.tokenizer] if args.tokenizer else list(dict.fromkeys([model_id, bench.endpoint.model]))
    err = None
    for name in names:
        try:
            bench.tok = load_tokenizer(name)
            return name
        except ValueError as e:
            err = err or e
    if args.tokenizer or args.dataset_name in ("random", "multi-round"):
        raise BenchError(str(err))
    print(f"note: no tokenizer ({err}); token counts come from the server's usage", file=sys.stderr)
    return None


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
    opts = flags.metric_options(args)
    metadata = flags.key_values(args.metadata, "--metadata")
    (n_in,) = flags.input_lens(args)
    workload = flags.workload_config(args, n_in)
    load = flags.load_config(args, args.request_rate, args.max_duration)
    record = new_record("serve", _args_dict(args))
    async with _open_bench(args, opts) as bench:
        model_id = _model_id(args, bench)
        tokenizer_id = _attach_tokenizer(bench, args, model_id)
        distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} ({distribution})\n"
              f"Maximum request concurrency: {args.max_concurrency}", flush=True)
        run = await bench.run(workload, load, stop=stop, label=f"rate={args.request_rate:g}")
    results = run["_results"]
    record["runs"].append(strip_live(run))
    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")  # vLLM stamps its file when the run has ended
    info = RunInfo(backend=args.backend, label=args.label, model_id=model_id, tokenizer_id=tokenizer_id,
                   num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
                   max_concurrency=args.max_concurrency, metadata=metadata, date=date,
                   percentile_metrics=opts.percentile_metrics, metric_percentiles=opts.metric_percentiles,
                   goodput=opts.goodput_ms is not None)
    print(failed_requests_note(results), end="")
    print(console_summary(run, opts.percentile_metrics, opts.metric_percentiles), end="", flush=True)
    if args.save_result or args.append_result:
        path = result_path(args.result_dir, args.result_filename, default_filename(info))
        result = result_dict(results, run["metrics"], info, args.save_detailed)
        print(f"wrote {write_result(result, path, append=args.append_result)}")
        rich = pdserve_record_path(path)
        if args.append_result and rich.exists():  # one pdserve record gathers the appended runs too
            try:
                old = load_json(rich)
                old["runs"] += record["runs"]
                record = old
            except (OSError, ValueError) as e:
                print(f"note: {rich} could not be read ({e}); writing a new record", file=sys.stderr)
        for p in write_outputs(record, rich, plots=False):
            print(f"wrote {p}")
    return 130 if run["interrupted"] else 0


def cmd_search(args) -> int:
    return _run_async(_search, args)


async def _search(args, stop: StopSignal) -> int:
    from pdserve.bench.trials import run_length_searches

    terms = parse_slo(args.slo)
    opts, cfg = flags.metric_options(args, terms), flags.search_config(args)
    lens = flags.input_lens(args)
    workload = flags.workload_config(args, lens[0])
    record = new_record("search", _args_dict(args))
    async with _open_bench(args, opts) as bench:
        model_id = _model_id(args, bench)
        _attach_tokenizer(bench, args, model_id)

        def on_search(section: dict) -> None:
            print(search_table(section), flush=True)

        await run_length_searches(bench, workload, flags.load_config(args), terms, cfg, stop, record, lens,
                                  early_stop=not args.no_early_stop, on_trial=_print_trial, on_search=on_search)
    if len(record.get("searches", [])) > 1:
        print(search_summary_markdown(record))
    path = record_path(args.result_dir, args.result_filename, default_name("search", model_id))
    for p in write_outputs(record, path, plots=not args.no_plots):
        print(f"wrote {p}")
    return 130 if stop.is_set else 0


def cmd_sweep(args) -> int:
    return _run_async(_sweep, args)


async def _sweep(args, stop: StopSignal) -> int:
    from pdserve.bench.trials import run_length_searches

    if args.dataset_name != "random":
        raise ValueError("sweep varies --random-input-len, so it needs --dataset-name random")
    if bool(args.slo) == bool(args.request_rates):
        raise ValueError("sweep needs exactly one of --slo (a search per input length) or --request-rates")
    terms = parse_slo(args.slo) if args.slo else None
    opts = flags.metric_options(args, terms)
    record = new_record("sweep", _args_dict(args))
    async with _open_bench(args, opts) as bench:
        model_id = _model_id(args, bench)
        _attach_tokenizer(bench, args, model_id)
        if terms:
            await run_length_searches(bench, flags.workload_config(args), flags.load_config(args), terms,
                                      flags.search_config(args), stop, record, args.input_lens,
                                      early_stop=not args.no_early_stop, on_trial=_print_trial,
                                      on_search=lambda s: print(search_table(s)))
        else:
            for n_in in args.input_lens:
                workload = flags.workload_config(args, n_in)
                for rate in args.request_rates:
                    if stop.is_set:
                        break
                    load = replace(flags.load_config(args, rate), request_id_prefix=f"{args.request_id_prefix}"
                                   f"{len(record['runs'])}-")
                    run = await bench.run(workload, load, stop=stop, label=f"in={n_in} rate={rate:g}")
                    record["runs"].append(strip_live(run))
                    print(f"input {n_in}, rate {rate:g}:")
                    print(console_summary(run, opts.percentile_metrics, opts.metric_percentiles))
                if stop.is_set:
                    break
    path = record_path(args.result_dir, args.result_filename, default_name("sweep", model_id))
    for p in write_outputs(record, path, plots=not args.no_plots):
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
    stem = output_stem(args.result_dir, args.result_filename, args.old_output, Path("compare.md"))
    for p in write_plots(list(zip(labels, records)), str(stem)):
        print(f"wrote {p}")
    md = "\n".join(f"## {label}\n\n" + to_markdown(rec) for label, rec in zip(labels, records))
    out = Path(f"{stem}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(f"wrote {out}")
    return 0


def cmd_plot(args) -> int:
    from pdserve.bench.plots import write_plots

    try:
        record = load_json(args.result)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stem = output_stem(args.result_dir, args.result_filename, args.old_output, Path(args.result))
    for p in write_plots([(Path(args.result).stem, record)], str(stem)):
        print(f"wrote {p}")
    return 0


def _print_trial(t) -> None:
    verdict = {True: "pass", False: "FAIL", None: "stopped"}[t.passed]
    vals = ", ".join(f"{k}={v:.1f}" for k, v in t.values.items())
    print(f"trial rate {t.rate:.3f} req/s: {verdict} ({t.num_sent} sent) {vals} {t.reason[:100]}", file=sys.stderr)


def _args_dict(args) -> dict:
    out = {}
    for k, v in vars(args).items():
        if k == "func" or callable(v) or k == "api_key":
            continue
        out[k] = "inf" if isinstance(v, float) and math.isinf(v) else v
    return json.loads(json.dumps(out, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench", description="Benchmarks for OpenAI-compatible servers")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)

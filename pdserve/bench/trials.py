"""SLO search trials against a live endpoint: each trial is one benchmark run judged against the SLO.

Connects the pure search (search.py) to real runs (runner.py): sizes each trial, stops it as soon as the
SLO is certain to fail or the time budget is spent, judges it with failed and unfinished requests counted as
infinitely late, and appends every trial's run (with all its samples) to the record.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, replace

from pdserve.bench.loadgen import LoadConfig, StopSignal, arrival_times
from pdserve.bench.runner import Bench, WorkloadConfig, strip_live
from pdserve.bench.search import SearchConfig, Trial, search_max_rate, trial_size
from pdserve.bench.slo import SLOTerm, certain_violation, goodput_limits, judge, slo_text


async def run_slo_search(
    bench: Bench,
    workload: WorkloadConfig,
    load: LoadConfig,
    terms: list[SLOTerm],
    cfg: SearchConfig,
    user_stop: StopSignal,
    record: dict,
    early_stop: bool = True,
    on_trial=None,
) -> dict:
    """Run the search; returns the search section (also appended to record["searches"])."""
    if not bench.metric_opts.goodput_ms:  # goodput at the found rate: requests meeting the SLO's own limits
        bench.metric_opts = replace(bench.metric_opts, goodput_ms=goodput_limits(terms) or None)

    async def trial(rate: float, seconds_left: float | None) -> Trial:
        if record["runs"] and cfg.cooldown_s > 0:
            try:  # let the server finish aborting the previous trial's requests
                await asyncio.wait_for(user_stop.event.wait(), cfg.cooldown_s)
            except asyncio.TimeoutError:
                pass
            if seconds_left is not None:
                seconds_left -= cfg.cooldown_s
        if user_stop.is_set:
            return Trial(rate=rate, passed=None, reason="interrupted")
        n = trial_size(rate, cfg)
        seed = workload.seed + len(record["runs"])
        window = cfg.max_duration_s if cfg.max_duration_s is not None else math.inf
        if seconds_left is not None:
            window = min(window, seconds_left)
        offsets = arrival_times(n, rate, load.burstiness, seed)
        n_expected = sum(1 for t in offsets if t <= window)
        deadline = None if seconds_left is None else time.perf_counter() + seconds_left

        def watch(results, now):
            if user_stop.is_set:
                return "interrupted"
            if deadline is not None and now > deadline:
                return "time_budget: the search ran out of time during this trial"
            return certain_violation(results, terms, n_expected, now) if early_stop else None

        prefix = f"{load.request_id_prefix}{len(record['runs'])}-" if load.request_id_prefix else ""
        trial_load = replace(load, request_rate=rate, seed=seed, request_id_prefix=prefix,
                             max_duration_s=None if math.isinf(window) else window)
        run = await bench.run(replace(workload, num_prompts=n, seed=seed), trial_load, stop=StopSignal(),
                              watcher=watch, label=f"rate={rate:g}")
        reason = run["stop_reason"] or ""
        if reason.startswith(("interrupted", "time_budget")):
            passed, values, why = None, {}, reason
        elif reason.startswith("early_stop"):
            passed, values, why = False, judge(run["_results"], terms)[1], reason
        else:
            passed, values, why = judge(run["_results"], terms)
        record["runs"].append(strip_live(run))
        t = Trial(rate=rate, passed=passed, reason=why, values=values, run_index=len(record["runs"]) - 1,
                  goodput=run["metrics"].get("request_goodput"), num_sent=run["num_sent"])
        if on_trial is not None:
            on_trial(t)
        return t

    result = await search_max_rate(trial, cfg)
    best = result.best_trial
    section = {
        "slo": slo_text(terms),
        "slo_terms": [asdict(t) for t in terms],
        "input_len": workload.random_input_len if workload.dataset_name == "random" else None,
        "output_len": workload.random_output_len if workload.dataset_name == "random" else None,
        "max_rate": result.max_rate,
        "min_failed_rate": result.min_failed_rate,
        "goodput": best.goodput if best else None,
        "stop_reason": result.stop_reason,
        "config": asdict(cfg),
        "trials": [
            {"rate": t.rate, "passed": t.passed, "reason": t.reason, "values": t.values, "run_index": t.run_index,
             "goodput": t.goodput, "num_sent": t.num_sent}
            for t in result.trials
        ],
    }
    record.setdefault("searches", []).append(section)
    return section


async def run_length_searches(
    bench: Bench,
    workload: WorkloadConfig,
    load: LoadConfig,
    terms: list[SLOTerm],
    cfg: SearchConfig,
    user_stop: StopSignal,
    record: dict,
    input_lens: list[int],
    early_stop: bool = True,
    on_trial=None,
    on_search=None,
) -> list[dict]:
    """One SLO search per input length, in order, into one record (the seeds' benchmark in one step).

    The first search starts at `cfg.start_rate`; each later one at the highest rate the previous length met
    (when it met one), which saves the probing trials when lengths grow and rates fall. Each search has its own
    trial and time budget; a Ctrl-C ends the current search and skips the rest. Returns the search sections
    (also in record["searches"]).
    """
    if len(input_lens) > 1 and workload.dataset_name != "random":
        raise ValueError("several input lengths need --dataset-name random")
    sections = []
    start = cfg.start_rate
    for n_in in input_lens:
        if user_stop.is_set:
            break
        section = await run_slo_search(bench, replace(workload, random_input_len=n_in), load, terms,
                                       replace(cfg, start_rate=start), user_stop, record, early_stop=early_stop,
                                       on_trial=on_trial)
        if section["max_rate"] is not None:
            start = min(max(section["max_rate"], cfg.min_rate), cfg.max_rate)
        sections.append(section)
        if on_search is not None:
            on_search(section)
    return sections

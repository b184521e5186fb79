"""The engine's stats line (pdserve.server.stats_log): rates over the interval from the engine's totals, the step
pace and the share of it spent waiting for the GPU, nothing for an idle interval, and the task that logs it."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.server.stats_log import StatsLine, log_stats


def snap(prompt=0, gen=0, steps=0, busy=0.0, wait=0.0, queries=0, hits=0, running=0, waiting=0, kv=0.0) -> dict:
    return {"prompt_tokens_total": prompt, "generation_tokens_total": gen, "num_steps": steps, "step_s": busy,
            "collect_wait_s": wait,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits, "num_running": running,
            "num_waiting": waiting, "kv_usage": kv}


def test_rates_pace_and_hit_rate_are_over_the_interval():
    t = StatsLine(100.0, snap(prompt=500, gen=40, steps=10, busy=0.2, wait=0.1, queries=100, hits=50))
    line = t.line(snap(prompt=8692, gen=9822, steps=620, busy=10.1, wait=8.9, queries=8292, hits=50, running=256,
                       waiting=12, kv=0.4523), 110.0)
    assert line == ("engine: prompt 819.2 tokens/s, generation 978.2 tokens/s; 61.0 steps/s, busy 99%, 16.2 ms a step, "
                    "89% of it waiting for the GPU; running 256, waiting 12; KV cache 45.2% used; prefix cache hit rate "
                    "0.0%")
    # the next interval starts where this one ended
    line = t.line(snap(prompt=8692, gen=9832, steps=630, busy=10.6, wait=8.9, queries=8392, hits=150, running=1,
                       kv=0.01), 115.0)
    assert "prompt 0.0 tokens/s, generation 2.0 tokens/s; 2.0 steps/s, busy 10%, 50.0 ms a step, 0% of it" in line
    assert line.endswith("prefix cache hit rate 100.0%")


def test_an_idle_interval_gives_no_line_and_a_queue_without_steps_does():
    t = StatsLine(0.0, snap(steps=5))
    assert t.line(snap(steps=5), 10.0) is None  # nothing computed, nothing held
    line = t.line(snap(steps=5, waiting=3), 20.0)  # requests wait but no step ran (all blocks taken, say)
    assert "no steps; running 0, waiting 3" in line and line.endswith("prefix cache hit rate -")
    assert t.line(snap(steps=6), 20.0) is None  # no time passed


def test_missing_totals_count_as_zero():
    t = StatsLine(0.0, None)
    line = t.line({"num_running": 2, "num_steps": 4}, 2.0)  # an engine without step times: no pace or wait share
    assert line.startswith("engine: prompt 0.0 tokens/s, generation 0.0 tokens/s; 2.0 steps/s; running 2, waiting 0")


def test_the_task_logs_a_line_an_interval_and_skips_failed_snapshots():
    calls = {"n": 0}

    async def stats():  # an awaitable snapshot, as the server's engine_stats gives; the third one fails
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("engine busy")
        return snap(gen=10 * calls["n"], steps=calls["n"], running=1)

    lines: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(log_stats(stats, 0.01, emit=lines.append))
        while calls["n"] < 5:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert len(lines) >= 3 and all(ln.startswith("engine: prompt 0.0 tokens/s") for ln in lines), lines
    assert all("running 1, waiting 0" in ln for ln in lines)


def test_disable_log_stats_and_the_interval_flag():
    import argparse

    from pdserve.config import ServerConfig
    from pdserve.server.main import add_arguments, build_config, config_argv

    p = add_arguments(argparse.ArgumentParser())
    assert build_config(p.parse_args([])).log_stats_interval_s == ServerConfig().log_stats_interval_s
    off = build_config(p.parse_args(["--disable-log-stats"]))
    assert off.log_stats_interval_s == 0 and config_argv(off) == ["--log-stats-interval", "0.0"]
    assert build_config(p.parse_args(["--log-stats-interval", "2.5"])).log_stats_interval_s == 2.5
    with pytest.raises(ValueError, match="must not be negative"):
        ServerConfig(log_stats_interval_s=-1)

"""bench_steps.py's GPU timeline (the async decode loop under the profiler): busy time is the union of the device's
intervals, idle time the rest of their span, and the longest gaps name the activity on either side; each activity's
marginal time (how far it pushes the device's latest end) sums to the busy time."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "bench_steps.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_steps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ev(name, start, end, cuda=True):
    dev = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=start, end=end))


def test_busy_idle_and_gaps():
    # two steps: a (0-100) overlapping b (50-120), a 30 us gap, c (150-200) containing d (160-170), a 100 us gap,
    # e (300-400); host events are ignored
    events = [_ev("a", 0, 100), _ev("b", 50, 120), _ev("c", 150, 200), _ev("d", 160, 170), _ev("e", 300, 400),
              _ev("host", 0, 1000, cuda=False)]
    g = _module().gpu_timeline(SimpleNamespace(events=lambda: events), steps=2)
    assert g["span_us_per_step"] == 200 and g["busy_us_per_step"] == (120 + 50 + 100) / 2
    assert g["idle_us_per_step"] == (30 + 100) / 2 and g["gaps_over_20us_per_step"] == 1
    assert [(x["us"], x["after"], x["before"]) for x in g["longest_gaps"]] == [(100, "c", "e"), (30, "b", "c")]
    assert _module().gpu_timeline(SimpleNamespace(events=lambda: events[-1:]), steps=2) == {}


def test_marginal_times_sum_to_the_busy_time():
    # a (0-100); b starts early under PDL (50) and ends at 130: it adds 30; c inside b adds 0; a gap, then d adds 50;
    # e (220-240) after a 20 us gap adds 20
    events = [_ev("a", 0, 100), _ev("b", 50, 130), _ev("c", 60, 120), _ev("d", 150, 200), _ev("e", 220, 240),
              _ev("host", 0, 1000, cuda=False)]
    m = _module().marginal_times(SimpleNamespace(events=lambda: events))
    assert dict(m) == {"a": [100], "b": [30], "c": [0.0], "d": [50], "e": [20]}
    g = _module().gpu_timeline(SimpleNamespace(events=lambda: events), steps=1)
    assert sum(sum(v) for v in m.values()) == g["busy_us_per_step"]

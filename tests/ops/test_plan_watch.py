"""The watcher of cuDNN attention plans built while serving (pdserve.ops.attention.plan_watch)."""

from __future__ import annotations

import logging

import torch

from pdserve.ops.attention.plan_watch import PlanWatch, describe

KEY = (((1, 32, 2048, 128), (1, 128, 4096, 1)), ((1, 8, 4096, 128), (1, 128, 1024, 1)),
       ((1, 8, 4096, 128), (1, 128, 1024, 1)), False, True, torch.bfloat16)


def test_shapes_met_after_arming_are_counted_once_and_logged(caplog):
    w = PlanWatch()
    w.record(("warm-up",), 0.08)  # during the warm-up: remembered, not counted
    assert w.seen(("warm-up",)) and not w.seen(KEY)
    w.arm()
    w.record(("warm-up",), 0.5)  # met before: nothing
    assert w.stats() == {"cudnn_plans_built_after_warmup": 0, "cudnn_plan_s_after_warmup": 0.0}
    with caplog.at_level(logging.WARNING, logger="pdserve.ops.attention.plan_watch"):
        w.record(KEY, 0.0712)
        w.record(KEY, 0.0001)  # a second call of that shape: its plan is cached
    assert w.stats() == {"cudnn_plans_built_after_warmup": 1, "cudnn_plan_s_after_warmup": 0.071}
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "0.071 s" in msg and "q [1, 32, 2048, 128] k [1, 8, 4096, 128] lse torch.bfloat16" in msg


def test_describe_falls_back_to_the_key():
    assert describe(("odd",)) == "('odd',)"

"""One short round of benchmarks/faults/kill_table.py: a real 1P1D deployment (`pdserve serve --prefill 1
--decode 1`, tiny random-weight Gemma 3 on CPU) under steady load; kill -9 the decode instance, then the prefill
instance (the launcher restarts each), then kill -9 and restart a router of its own process in front of the same
instances. No request may be lost (each completes or gets a clean error), every KV pool must be whole afterwards,
requests are disaggregated again after each kill, the launcher's restarted instances serve, and no process of a
killed one is left running."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

import pytest

from pdserve.model.dummy_tokenizer import wordlevel_tokenizer_dir
from pdserve.model.loader import load_config, resolve_model
from tests.engine.tiny_models import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "faults" / "kill_table.py"


def _kill_table():
    spec = importlib.util.spec_from_file_location("kill_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_kill_decode_prefill_and_router_lose_nothing_and_leave_pools_whole(tmp_path):
    kt = _kill_table()
    model = write_tiny_model("gemma3", tmp_path / "gemma3")
    tok = wordlevel_tokenizer_dir(load_config(resolve_model(str(model)))[0], tmp_path)
    # --kv-lease 10: a reservation whose prefill peer was killed mid-order is quarantined until its lease ends; at
    # the default 30 s the pool check after the prefill kill waited ~23 s for it (pools whole the same, sooner)
    instance = ["--model", str(model), "--tokenizer", str(tok), "--max-model-len", "256", "--num-gpu-blocks", "64",
                "--block-size", "4", "--dtype", "float32", "--kv-lease", "10"]
    router = [*kt.ROUTER_ARGS, "--breaker-cooldown", "1"]  # probe a restarted instance sooner: a shorter test
    args = kt.parse_args(["--reps", "1", "--concurrency", "2", "--warmup", "0.5", "--settle", "0.5",
                          "--deadline", "30", "--recovery-timeout", "90", "--pool-timeout", "45", "--startup-timeout",
                          "120", "--no-chat", "--vocab", "wordlevel", "--instance-args", shlex.join(instance),
                          "--router-args", shlex.join(router), "--workdir", str(tmp_path / "run")])
    result = kt.run(args)
    print(kt.table(result["reps"]))  # shown with -s, and on failure
    reps = {r["scenario"]: r for r in result["reps"]}
    assert set(reps) == {"decode", "prefill", "router"}
    for name, r in reps.items():
        assert r["lost"] == 0, (name, r["lost_kinds"], r)
        assert r["pools_whole"], (name, r["pools"])
        assert r["sent"] == r["completed"] + r["clean_errors"] and r["completed"] > 0, r
        assert r["recovery_s"] is not None and r["pd_after"], (name, r)
        assert not r["note"], r
        assert r["left_behind"] == [], (name, r["left_behind"])  # the killed process's helpers ended with it
    for name in ("decode", "prefill"):  # the launcher restarted the instance, which then served
        assert reps[name]["restart_healthy_s"] is not None and reps[name]["restart_serving_s"] is not None, reps[name]
    assert reps["decode"]["clean_errors"] > 0  # one decode instance: clients saw its death as errors, not silence
    assert set(reps["router"]["errors"]) <= {"connection refused", "connection reset (ServerDisconnectedError)",
                                             "connection reset (ClientPayloadError)",
                                             "connection reset (ClientOSError)", "HTTP 503 overloaded"}

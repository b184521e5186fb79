"""An instance killed with SIGKILL (the OOM killer, `kill -9`, the kill tests of benchmarks/faults/kill_table.py)
leaves no process of its own behind: its engine process sees its pipe close, its tokenizer workers watch the
server's pid (they used to block for good on their task queue, and with them multiprocessing's resource tracker)."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from pdserve.model.dummy_tokenizer import wordlevel_tokenizer_dir
from pdserve.model.loader import load_config, resolve_model
from tests.engine.tiny_models import write_tiny_model
from tests.server.live_server import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_sigkilled_instance_leaves_no_process_behind(tmp_path):
    model = write_tiny_model("gemma3", tmp_path / "gemma3")
    tok = wordlevel_tokenizer_dir(load_config(resolve_model(str(model)))[0], tmp_path)
    server = LiveServer("--model", str(model), "--tokenizer", str(tok), "--max-model-len", "256", "--num-gpu-blocks",
                        "64", "--block-size", "4", "--dtype", "float32", "--tokenizer-workers", "1")
    children: list[psutil.Process] = []
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        kinds = " ".join(" ".join(c.cmdline()) for c in children)
        assert "spawn_main" in kinds, kinds  # the engine process and the tokenizer worker
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        for p in children:  # whatever a failure left
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        server.stop()

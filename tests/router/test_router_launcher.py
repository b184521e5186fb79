"""`pdserve serve --prefill X --decode Y` with fake instances: starts, serves, stops everything on SIGINT."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.router.router_harness import wait_line

FAKE = Path(__file__).with_name("fake_instance.py")
ROOT = Path(__file__).resolve().parents[2]


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)




def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.router.launcher", "--port", "0", "--log-dir", str(tmp_path),
           "--instance-command", f"{sys.executable} {FAKE}", "--startup-timeout", "30", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_launcher_serves_and_stops_every_child(tmp_path):
    proc = _launch(tmp_path, "--prefill", "1", "--decode", "2", "--local-prefill-max-tokens", "0")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        m = wait_line(lines, r"ready: send OpenAI requests to (http://\S+)/v1", 60, seen)
        url = m.group(1)
        pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)", "".join(seen))]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        req = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hello " * 40, "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["choices"][0]["text"] == " t0 t1"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not any(_alive(p) for p in pids), "an instance outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launcher_reports_an_instance_that_fails_to_start(tmp_path):
    bad = tmp_path / "bad_instance.py"
    bad.write_text("import sys\nprint('cannot load the model')\nsys.exit(3)\n")
    cmd = [sys.executable, "-m", "pdserve.router.launcher", "--port", "0", "--log-dir", str(tmp_path),
           "--instance-command", f"{sys.executable} {bad}", "--decode", "1", "--startup-timeout", "30"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1
    assert "exited with code 3" in out.stderr and "cannot load the model" in out.stderr


def test_launcher_refuses_bad_flags():
    cmd = [sys.executable, "-m", "pdserve.router.launcher", "--prefill", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "--decode" in out.stderr


def test_launcher_accepts_the_namespace_of_pdserve_serve():
    """`pdserve serve` parses instance flags + --prefill/--decode/--router-port itself, then calls launcher.run."""
    import argparse

    from pdserve.router.launcher import add_arguments, instance_argv, normalize_args
    from pdserve.server.main import add_arguments as add_instance_arguments

    p = add_instance_arguments(argparse.ArgumentParser())
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--decode", type=int, default=0)
    p.add_argument("--router-port", type=int, default=None)
    args = p.parse_args(["--prefill", "1", "--decode", "2", "--max-model-len", "256", "--port", "9000",
                         "--no-enable-prefix-caching", "--router-port", "9100"])
    normalize_args(args)
    assert args.port == 9100 and args.both == 0 and args.startup_timeout > 0 and args.instance_base_port is None
    assert instance_argv(args) == ["--max-model-len", "256", "--no-enable-prefix-caching"]
    add_arguments(p)  # the launcher's own flags go on such a parser without conflicts
    assert p.parse_args(["--decode", "1", "--local-prefill-max-tokens", "0"]).local_prefill_max_tokens == 0


def test_launcher_restarts_an_instance_that_died(tmp_path):
    # the router probes an instance it took out after 1 s instead of 5 (the default): the restarted instance is
    # routed to again sooner, by the same probe
    proc = _launch(tmp_path, "--decode", "1", "--breaker-cooldown", "1")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        m = wait_line(lines, r"ready: send OpenAI requests to (http://\S+)/v1", 60, seen)
        url = m.group(1)
        started = re.search(r"started decode0 \(pid (\d+).*?on (http://\S+), log \S+: (.*)", "".join(seen))
        pid, inst_url, cmd = int(started.group(1)), started.group(2), started.group(3)
        assert "--role decode" in cmd and "--port" in cmd  # the command line is printed
        os.kill(pid, signal.SIGKILL)
        wait_line(lines, r"instance decode0 exited with code -9; restarting it in 1 s", 30, seen)
        new_pid = int(wait_line(lines, r"restarted decode0 \(pid (\d+), restart 1\)", 30, seen).group(1))
        assert new_pid != pid and _alive(new_pid)
        deadline = time.monotonic() + 30
        while True:  # the same port answers again, and the router routes to it
            try:
                with urllib.request.urlopen(inst_url + "/health", timeout=2) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, "the restarted instance never answered"
                time.sleep(0.2)
        req = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hello", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert json.loads(resp.read())["choices"][0]["text"] == " t0 t1"
                break
            except urllib.error.HTTPError as e:  # 503 until the router's health check saw it back
                assert e.code == 503 and time.monotonic() < deadline
                time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not _alive(new_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _plan(*argv: str):
    import argparse

    from pdserve.router.launcher import add_arguments, normalize_args, plan_children

    return plan_children(normalize_args(add_arguments(argparse.ArgumentParser()).parse_args(list(argv))))


def test_tensor_parallel_sizes_per_role_and_consecutive_gpus():
    from pdserve.router.launcher import assign_gpus

    plan = _plan("--prefill", "1", "--decode", "2", "--decode-tp", "2")
    assert plan == [("prefill", "prefill0", 1), ("decode", "decode0", 2), ("decode", "decode1", 2)]
    assert assign_gpus(plan, 5, False) == [0, 1, 3]  # cuda:1 holds decode0's rank 0, cuda:2 its rank 1
    assert assign_gpus(plan, 0, False) == [None] * 3  # CPU
    with pytest.raises(ValueError, match="need 5 GPUs"):
        assign_gpus(plan, 4, False)
    assert assign_gpus(plan, 4, True) == [0, 1, 0]  # shared: a TP group never wraps past the last GPU
    with pytest.raises(ValueError, match="needs 2 GPUs; 1 are visible"):
        assign_gpus(plan, 1, True)
    # -tp is every instance's default; a role's flag wins
    assert [tp for _, _, tp in _plan("-tp", "2", "--prefill", "1", "--prefill-tp", "1", "--decode", "1",
                                     "--both", "1")] == [1, 2, 2]
    with pytest.raises(ValueError, match="--decode-tp must be at least 1"):
        _plan("--decode", "1", "--decode-tp", "0")


def test_launcher_gives_each_role_its_tensor_parallel_size(tmp_path):
    proc = _launch(tmp_path, "-tp", "2", "--prefill", "1", "--prefill-tp", "1", "--decode", "1",
                   "--local-prefill-max-tokens", "0")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        wait_line(lines, r"ready: send OpenAI requests to (http://\S+)/v1", 60, seen)
        started = {m.group(1): m.group(2).split() for m in
                   re.finditer(r"started (\S+) \(pid \d+, [^)]*\) on \S+, log \S+: (.*)", "".join(seen))}

        def size(argv: list[str]) -> str:  # the last one wins (the instances' -tp comes first)
            return argv[len(argv) - 1 - argv[::-1].index("--tensor-parallel-size") + 1]

        assert size(started["prefill0"]) == "1" and size(started["decode0"]) == "2", started
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_isolate_gpus_gives_each_instance_only_its_own(tmp_path, monkeypatch):
    import argparse

    from pdserve.router import launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(launcher.Child, "start", lambda self: None)
    parser = launcher.add_arguments(argparse.ArgumentParser())
    for flags, envs, devices in ((["--isolate-gpus"], ["3", "5"], ["cuda:0", "cuda:0"]),
                                 ([], ["3,5", "3,5"], ["cuda:0", "cuda:1"])):
        args = launcher.normalize_args(parser.parse_args(["--prefill", "1", "--decode", "1", *flags]))
        children = launcher.spawn_children(args, tmp_path)
        assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == envs
        assert [c.cmd[c.cmd.index("--device") + 1] for c in children] == devices

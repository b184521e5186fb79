"""The `pdserve` entry point wires every subcommand to its module (the modules' own tests cover what they do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("sub,flag", [("serve", "--prefill"), ("serve", "--kv-fallback"), ("instance", "--role"),
                                      ("router", "--decode"), ("bench", "transfer")])
def test_subcommand_help_lists_its_flags(sub, flag):
    r = pdserve(sub, "--help")
    assert r.returncode == 0, r.stderr
    assert flag in r.stdout


def test_bench_transfer_through_the_cli_writes_its_record(tmp_path):
    out = tmp_path / "t.json"
    r = pdserve("bench", "transfer", "--transport", "tcp", "--block-bytes", "65536", "--num-blocks", "32",
                "--iters", "2", "--warmup", "1", "--latency-iters", "3", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert rec["checks"]["write_checksums_match"] and rec["checks"]["read_checksums_match"]
    assert rec["args"]["num_blocks"] == 32


def test_unknown_subcommand_is_an_error():
    r = pdserve("frobnicate")
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_a_pd_instance_without_the_deployment_secret_is_refused_at_once():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_DEPLOYMENT_SECRET")}
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "instance", "--role", "decode", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    assert "needs the deployment secret" in r.stderr and "--deployment-secret-file" in r.stderr

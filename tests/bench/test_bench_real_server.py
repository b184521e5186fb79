"""Against a real pdserve instance with the default model (Gemma 3 270M GGUF on CPU): small and marked slow."""

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench.cli import main
from pdserve.bench.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    if importlib.util.find_spec("pdserve.cli") is not None:
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    else:  # until the top-level CLI lands, the instance module serves the same API
        cmd = [sys.executable, "-m", "pdserve.server", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pdserve exited early: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("pdserve did not become healthy within 180 s")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_pdserve(server_url, endpoint, tmp_path):
    n_in, n_out = 24, 4
    rc = main(["serve", "--base-url", server_url, "--endpoint", endpoint, "--num-prompts", "3",
               "--random-input-len", str(n_in), "--random-output-len", str(n_out), "--ignore-eos",
               "--request-rate", "inf", "--disable-tqdm", "--capacity-duration", "0.5", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "real.json"])
    assert rc == 0
    vllm = json.loads((tmp_path / "real.json").read_text())
    run = json.loads((tmp_path / "real.pdserve.json").read_text())["runs"][0]
    assert run["config"]["model"] == "gemma-3-270m"  # read from /v1/models
    assert run["metrics"]["completed"] == 3 and run["metrics"]["failed"] == 0
    added = load_tokenizer("gemma-3-270m").num_special_tokens_added
    assert vllm["model_id"] and vllm["tokenizer_id"] == vllm["model_id"]  # /v1/models' root, as vLLM
    assert vllm["completed"] == 3 and vllm["total_output_tokens"] == 3 * n_out
    for s in run["requests"]:
        assert s["output_tokens"] == s["server_completion_tokens"] == n_out
        assert s["chunks"] >= 1 and s["ttft"] > 0 and s["e2el"] >= s["ttft"]
        if endpoint == "/v1/completions":  # as vLLM: --random-input-len counts the <bos> the server adds
            assert s["prompt_len"] == n_in - added and s["server_prompt_tokens"] == s["input_tokens"] == n_in
        else:  # the chat template wraps the prompt
            assert s["server_prompt_tokens"] > n_in
    assert run["client_capacity"]["request_throughput"] > run["metrics"]["request_throughput"]

"""Start a real `python -m pdserve.server` process for tests, and stop it cleanly.

Why --port 0 and the ready line: the server binds a free port itself and prints it, so two test runs never race
for a port, and "ready" means the model is loaded and the socket is listening.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

READY = re.compile(r"pdserve: serving (\S+) on (http://\S+) \(role (\w+)\)")
# every test server gets this deployment secret (PD orders must be signed with it: see pd_headers)
SECRET = "pdserve-tests-deployment-secret-0123456789"
START_TIMEOUT_S = 300.0  # first start converts the GGUF tokenizer (~15 s) and assembles the default model
STOP_TIMEOUT_S = 60.0


def pd_headers(body: bytes, path: str = "/v1/completions") -> dict[str, str]:
    """Headers signing `body` (sent to `path`) with the test servers' deployment secret, as the router signs the
    requests it sends with a `pd` field; an instance refuses `pd` in an unsigned request."""
    from pdserve.signing import sign_request

    return {"Content-Type": "application/json", **sign_request(SECRET.encode(), "POST", path, body)}


def parse_sse(raw: str) -> list:
    """A whole SSE body: every event must be `data: <json or [DONE]>` followed by a blank line."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class LiveServer:
    def __init__(self, *args: str, start_timeout_s: float = START_TIMEOUT_S):
        cmd = [sys.executable, "-m", "pdserve.server", "--port", "0", "--device", "cpu", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_DEPLOYMENT_SECRET": SECRET}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()  # keeps the pipe drained for the server's life
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"server not ready in {start_timeout_s:g} s; output:\n{self.output()}") from None
            if line is None:
                raise RuntimeError(f"server exited with {self.proc.wait()} before it was ready:\n{self.output()}")
            m = READY.search(line)
            if m:
                self.model, self.url, self.role = m.group(1), m.group(2), m.group(3)
                return

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def get_json(self, path: str, timeout_s: float = 10.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        """SIGINT (what Ctrl-C sends) and wait for a clean exit; kill only if it does not come."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
                raise RuntimeError(f"server did not stop within {STOP_TIMEOUT_S:g} s:\n{self.output()}") from None
        return self.proc.returncode


def start_in_parallel(start, specs: dict[str, tuple], stop) -> dict:
    """start(*spec) for every spec at once: the processes load their models in parallel (one start is mostly one
    process's work, so on a machine of two or more cores a set starts in little more than one's time). If any fails
    to start, stop(result) is called on each of the others and its error is raised."""
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futs = {name: pool.submit(start, *spec) for name, spec in specs.items()}
        concurrent.futures.wait(futs.values())
    failed = [f for f in futs.values() if f.exception() is not None]
    if failed:
        for f in futs.values():
            if f.exception() is None:
                stop(f.result())
        raise failed[0].exception()
    return {name: f.result() for name, f in futs.items()}


def start_servers(specs: dict[str, tuple[str, ...]]) -> dict[str, LiveServer]:
    """LiveServer(*args) for every spec at once (start_in_parallel)."""
    return start_in_parallel(LiveServer, specs, LiveServer.stop)


def stop_servers(servers: list[LiveServer]) -> list[int]:
    """stop() every server at once (each waits for its own clean exit); their exit codes in order. Every one is
    stopped before the first error (a server that would not stop) is raised."""
    if not servers:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        futs = [pool.submit(s.stop) for s in servers]
        concurrent.futures.wait(futs)
    return [f.result() for f in futs]

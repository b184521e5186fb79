"""Kill tests of a 1P1D deployment on CPU, with the numbers recorded.

Starts `pdserve serve --prefill 1 --decode 1` (the launcher: router in its process, instances as children that it
restarts with backoff when they die), drives a steady stream of concurrent requests (completions and chat,
streaming and not, `max_tokens` small so a CPU keeps up, `ignore_eos` so a full answer has exactly `max_tokens`
tokens) and, repeated `--reps` times each:

  decode   kill -9 the decode instance (the launcher restarts it)
  prefill  kill -9 the prefill instance (the launcher restarts it)
  router   kill -9 a router run as its own process (`pdserve router` in front of the same instances) and start it
           again on the same port; the instances are kept

For each repetition it records requests sent, completed (HTTP 200 and the whole answer: a finish reason and
`max_tokens` completion tokens; for streams `data: [DONE]` too), clean errors (a non-200 answer with OpenAI's JSON
error body, or a stream that carries an error event), lost (no answer within `--deadline`, a stream cut without an
error event or a finish, a 200 with a partial answer, an error without a JSON error body; must be 0), time to
recovery (kill -> the first request sent after the kill that completed), for instance kills the time until the
launcher's new instance answers /health and until it has served (its /load shows engine steps), and whether every
instance's KV pool is whole afterwards (/load: free blocks back to the idle value, which is every block, nothing
running, waiting, importing, exporting or quarantined), and which processes of the killed one were still running at
the end of the repetition (its process group: an instance's engine process and tokenizer workers must end with it).
SIGKILL goes to the process itself, not to its group, as the OOM killer or an operator would send it.

While the router process is dead its clients get connection refused (or, for requests in flight, a connection
reset): in the router scenario those count as clean errors, since the client sees an error at once; in the
instance scenarios the router stays up and must answer every request itself, so a refused or reset connection
there counts as lost.

Every wait is bounded; every process started here is stopped at the end (process groups), also on failure.

    python benchmarks/faults/kill_table.py --reps 3      # writes results_cpu/kill_table.json and .md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = Path(__file__).resolve().parent / "results_cpu"
SCENARIOS = ("decode", "prefill", "router")
# every request is disaggregated (no local prefill of short prompts), and the routers poll often
ROUTER_ARGS = ["--local-prefill-max-tokens", "0", "--health-interval", "0.2"]
INSTANCE_ARGS = ["--max-model-len", "512", "--cpu-kv-cache-gb", "0.25"]

ENGLISH = ("river stone cloud seven lantern harbour window orange quiet garden paper engine silver morning "
           "mountain letter candle forest winter market bridge yellow island story").split()


# ---------------------------------------------------------------- processes


class Proc:
    """A child in its own process group; its output is kept (and appended to `log`) by a reader thread."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        self.lines: list[str] = []
        self.popen = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with open(self.log, "a") as fh:
            for line in iter(self.popen.stdout.readline, ""):
                self.lines.append(line)
                fh.write(line)
                fh.flush()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    async def wait_line(self, pattern: str, timeout: float, start: int = 0) -> tuple[re.Match, int]:
        """The first output line from index `start` on matching `pattern`, and the index after it."""
        deadline = time.monotonic() + timeout
        i = start
        while True:
            while i < len(self.lines):
                m = re.search(pattern, self.lines[i])
                i += 1
                if m:
                    return m, i
            if not self.alive() and i >= len(self.lines):
                await asyncio.sleep(0.2)  # let the reader thread catch the last lines
                if i >= len(self.lines):
                    raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before printing {pattern!r}:\n"
                                       + "".join(self.lines[-30:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no line matching {pattern!r} within {timeout:.0f} s:\n"
                                   + "".join(self.lines[-30:]))
            await asyncio.sleep(0.05)

    def kill9(self) -> None:
        """SIGKILL to the process itself (not its group), as the OOM killer or an operator would."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def stop(self, grace: float = 20.0, sig: int = signal.SIGTERM) -> None:
        """`sig` to the group, then SIGKILL to the group after `grace`."""
        if self.alive():
            killpg(self.pid, sig)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        killpg(self.pid, signal.SIGKILL)  # also whatever it left in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


def killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def group_left(pgid: int) -> list[str]:
    """Command lines of the processes still in process group `pgid` (what a killed process left behind)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.info["cmdline"] or [])[:160])
        except (ProcessLookupError, psutil.Error, OSError):
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


class Deployment:
    """`pdserve serve --prefill 1 --decode 1` (router + two instances it restarts), plus optionally a router of its
    own process in front of the same instances (the router scenario)."""

    def __init__(self, workdir: Path, instance_args: list[str], router_args: list[str], startup_timeout: float) -> None:
        self.workdir = workdir
        self.instance_args = instance_args
        self.router_args = router_args
        self.startup_timeout = startup_timeout
        self.launcher: Proc | None = None
        self.router: Proc | None = None  # the router of its own process
        self.router_port = 0
        self.router_url = ""  # the launcher's router
        self.urls: dict[str, str] = {}  # prefill0 / decode0 -> URL
        self.pids: dict[str, list[int]] = {}  # every pid each instance had (all are killed at the end)

    @property
    def logdir(self) -> Path:
        return self.workdir / "logs"

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--prefill", "1", "--decode", "1", "--port", "0",
               "--log-dir", str(self.logdir), "--startup-timeout", str(self.startup_timeout), *self.router_args,
               *self.instance_args]
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.launcher = Proc("pdserve serve", cmd, child_env(), self.workdir / "launcher.log")
        m, _ = await self.launcher.wait_line(r"ready: send OpenAI requests to (http://\S+)/v1", self.startup_timeout + 30)
        self.router_url = m.group(1)
        for line in self.launcher.lines:
            s = re.search(r"started (\w+) \(pid (\d+), .*?\) on (http://\S+), log", line)
            if s:
                self.urls[s.group(1)] = s.group(3)
                self.pids.setdefault(s.group(1), []).append(int(s.group(2)))
        if set(self.urls) != {"prefill0", "decode0"}:
            raise RuntimeError(f"unexpected instances {self.urls}")

    def pid(self, name: str) -> int:
        return self.pids[name][-1]

    async def await_restart(self, name: str, start: int, timeout: float) -> int:
        """The pid of `name`'s restart that the launcher prints after its output line `start`."""
        m, _ = await self.launcher.wait_line(rf"restarted {name} \(pid (\d+), restart \d+\)", timeout, start)
        pid = int(m.group(1))
        self.pids[name].append(pid)
        return pid

    async def start_router(self, timeout: float = 60.0) -> float:
        """Start (or restart) the router of its own process on `router_port`; returns its start-up seconds."""
        if not self.router_port:
            self.router_port = free_port()
        cmd = [sys.executable, "-m", "pdserve.router", "--port", str(self.router_port), "--prefill",
               self.urls["prefill0"], "--decode", self.urls["decode0"], "--deployment-secret-file",
               str(self.logdir / "deployment-secret"), *self.router_args]
        t0 = time.monotonic()
        self.router = Proc("pdserve router", cmd, child_env(), self.workdir / "router.log")
        await self.router.wait_line(r"serving on (http://\S+)", timeout)
        return time.monotonic() - t0

    @property
    def own_router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        if self.launcher is not None:
            self.launcher.stop(sig=signal.SIGINT, grace=30)  # the launcher stops its instances
        for pids in self.pids.values():  # and whatever of theirs is left, whatever happened
            for pid in pids:
                killpg(pid, signal.SIGKILL)


# ---------------------------------------------------------------- load


@dataclass
class Result:
    start: float
    end: float
    path: str
    stream: bool
    outcome: str  # completed | clean_error | lost
    detail: str
    retry_after: float = 0.0  # the Retry-After of a 503


class Load:
    """`concurrency` clients, each sending one request after another until stopped; every request ends in a
    Result (bounded by `deadline`). After a failed request a client pauses `error_pause` seconds."""

    KINDS = (("/v1/completions", False), ("/v1/chat/completions", True), ("/v1/completions", True),
             ("/v1/chat/completions", False))

    def __init__(self, session: aiohttp.ClientSession, url: str, *, concurrency: int, max_tokens: int,
                 deadline: float, chat: bool, vocab: str, conn_errors_clean: bool, seed: int,
                 error_pause: float = 0.25) -> None:
        self.session, self.url = session, url
        self.concurrency, self.max_tokens, self.deadline = concurrency, max_tokens, deadline
        self.kinds = self.KINDS if chat else tuple(k for k in self.KINDS if k[0] == "/v1/completions")
        self.vocab = vocab
        self.conn_errors_clean = conn_errors_clean
        self.rng = random.Random(seed)
        self.error_pause = error_pause
        self.results: list[Result] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        """Stop sending; wait for the requests in flight (each bounded by the deadline)."""
        self._stop.set()
        done, pending = await asyncio.wait(self._tasks, timeout=self.deadline + 30)
        for t in pending:  # cannot happen (every request has a deadline); never hang on it
            t.cancel()
        for t in done:
            if t.exception() is not None:
                raise t.exception()

    def prompt(self) -> str:
        n = self.rng.randint(12, 40)
        if self.vocab == "wordlevel":
            return " ".join(f"t{self.rng.randint(5, 200)}" for _ in range(n))
        return "Write about " + " ".join(self.rng.choice(ENGLISH) for _ in range(n)) + "."

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            path, stream = self.kinds[(i + n) % len(self.kinds)]
            n += 1
            r = await self.one(path, stream)
            self.results.append(r)
            if r.outcome != "completed":  # as a polite client: wait, at least as long as Retry-After says
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(self.error_pause, min(r.retry_after, 5.0)))

    async def one(self, path: str, stream: bool) -> Result:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                                "stream": stream}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": self.prompt()}]
        else:
            body["prompt"] = self.prompt()
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.monotonic()

        def done(outcome: str, detail: str, retry_after: str | None = None) -> Result:
            wait = float(retry_after) if retry_after and retry_after.isdigit() else 0.0
            return Result(t0, time.monotonic(), path, stream, outcome, detail, wait)

        conn = "clean_error" if self.conn_errors_clean else "lost"
        try:
            return await asyncio.wait_for(self._exchange(path, body, stream, done), self.deadline)
        except asyncio.TimeoutError:
            return done("lost", "no answer within the deadline")
        except aiohttp.ClientConnectorError:
            return done(conn, "connection refused")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
            return done(conn, f"connection reset ({type(e).__name__})")

    async def _exchange(self, path: str, body: dict, stream: bool, done) -> Result:
        async with self.session.post(self.url + path, json=body) as resp:
            if resp.status != 200 or not stream:
                raw = await resp.read()
                try:
                    obj = json.loads(raw)
                except ValueError:
                    return done("lost", f"HTTP {resp.status} without a JSON body: {raw[:100]!r}")
                if resp.status != 200:
                    err = obj.get("error") if isinstance(obj, dict) else None
                    if isinstance(err, dict) and err.get("message"):
                        return done("clean_error", f"HTTP {resp.status} {err.get('type')}",
                                    resp.headers.get("Retry-After"))
                    return done("lost", f"HTTP {resp.status} without an error object")
                choice = (obj.get("choices") or [{}])[0]
                tokens = (obj.get("usage") or {}).get("completion_tokens")
                if choice.get("finish_reason") in ("length", "stop") and tokens == self.max_tokens:
                    return done("completed", "")
                return done("lost", f"HTTP 200 with a partial answer ({tokens} tokens, {choice.get('finish_reason')})")
            saw_done = saw_error = False
            finish = tokens = None
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:].strip()
                    if payload == b"[DONE]":
                        saw_done = True
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        saw_error = True
                        continue
                    for c in obj.get("choices") or []:
                        finish = c.get("finish_reason") or finish
                    if obj.get("usage"):
                        tokens = obj["usage"].get("completion_tokens")
            if saw_error:
                return done("clean_error", "error event in the stream")
            if saw_done and finish in ("length", "stop") and tokens == self.max_tokens:
                return done("completed", "")
            return done("lost", f"stream ended without an error or a whole answer (done={saw_done}, "
                                f"finish={finish}, tokens={tokens})")


# ---------------------------------------------------------------- checks


async def get_json(session: aiohttp.ClientSession, url: str, timeout: float = 2.0) -> dict | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def pool_whole(ld: dict | None, idle_free: int | None) -> bool:
    """Idle with every KV block free (cached blocks no request holds count as free), nothing imported, exported
    or quarantined."""
    if not ld:
        return False
    pd = ld.get("pd") or {}
    return (ld["num_free_blocks"] == ld["num_total_blocks"]
            and (idle_free is None or ld["num_free_blocks"] == idle_free)
            and ld["num_running"] == 0 and ld["num_waiting"] == 0 and ld.get("num_remote", 0) == 0
            and ld.get("num_exporting", 0) == 0 and not pd.get("quarantine_blocks")
            and not pd.get("pushes_in_flight") and not pd.get("waiting_for_kv"))


def pool_summary(ld: dict | None) -> dict:
    if not ld:
        return {"answered": False}
    pd = ld.get("pd") or {}
    return {k: ld.get(k) for k in ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "num_remote",
                                   "num_exporting")} | {"quarantine_blocks": pd.get("quarantine_blocks"),
                                                        "pushes_in_flight": pd.get("pushes_in_flight"),
                                                        "waiting_for_kv": pd.get("waiting_for_kv")}


async def wait_pools_whole(session: aiohttp.ClientSession, urls: dict[str, str], idle: dict[str, int] | None,
                           timeout: float) -> tuple[bool, float, dict[str, dict], dict[str, dict]]:
    """(whole, seconds it took, the last /load of each instance, what was not whole at the first look)."""
    t0 = time.monotonic()
    first: dict[str, dict] = {}
    while True:
        loads = {n: await get_json(session, u + "/load") for n, u in urls.items()}
        not_whole = {n: pool_summary(ld) for n, ld in loads.items() if not pool_whole(ld, (idle or {}).get(n))}
        if not not_whole:
            return True, time.monotonic() - t0, loads, first
        first = first or not_whole
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0, loads, first
        await asyncio.sleep(0.2)


async def wait_router_ready(session: aiohttp.ClientSession, router: str, timeout: float) -> None:
    """Until the router sees every instance healthy (breakers closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await get_json(session, router + "/router/status")
        if st and st["instances"] and all(i["state"] == "closed" for i in st["instances"]):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"router {router} did not see every instance healthy within {timeout:.0f} s: {st}")


async def wait_instance(session: aiohttp.ClientSession, url: str, t_kill: float, timeout: float) -> tuple[float | None, float | None]:
    """Seconds from the kill until a (restarted) instance answers /health 200, and until it has served (/load shows
    engine steps, which a fresh process starts at 0)."""
    deadline = t_kill + timeout
    healthy = serving = None
    while time.monotonic() < deadline:
        if healthy is None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        healthy = time.monotonic() - t_kill
        if healthy is not None:
            ld = await get_json(session, url + "/load")
            if ld and ld.get("num_steps", 0) > 0:
                serving = time.monotonic() - t_kill
                break
        await asyncio.sleep(0.1)
    return healthy, serving


async def router_pd_ok(session: aiohttp.ClientSession, router: str) -> float:
    """The router's count of disaggregated requests answered."""
    try:
        async with session.get(router + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0.0
    m = re.search(r'pdserve:router_requests_total\{mode="pd",outcome="ok"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------- one repetition


@dataclass
class Rep:
    scenario: str
    rep: int
    sent: int = 0
    completed: int = 0
    clean_errors: int = 0
    lost: int = 0
    recovery_s: float | None = None  # kill -> the first request sent after the kill that completed
    first_completion_s: float | None = None  # kill -> the first request completed (one in flight at the kill too)
    restart_healthy_s: float | None = None  # kill -> the new instance (router) answers
    restart_serving_s: float | None = None  # kill -> the new instance has served requests
    pools_whole: bool = False
    pools_whole_after_s: float | None = None  # load stopped -> every pool whole
    pools: dict[str, dict] = field(default_factory=dict)  # idle and final free/total blocks per instance
    pools_not_whole_at_stop: dict[str, dict] = field(default_factory=dict)  # when the load stopped, if any
    pd_after: bool | None = None  # requests were disaggregated again after the kill
    left_behind: list[str] = field(default_factory=list)  # processes of the killed one still running at the end
    loadavg_1m: float | None = None  # the machine's load at the kill (CPU timings depend on what else runs)
    errors: dict[str, int] = field(default_factory=dict)  # clean errors by kind
    lost_kinds: dict[str, int] = field(default_factory=dict)
    note: str = ""


async def run_rep(dep: Deployment, session: aiohttp.ClientSession, scenario: str, rep: int,
                  args: argparse.Namespace) -> Rep:
    out = Rep(scenario, rep)
    router = dep.own_router_url if scenario == "router" else dep.router_url
    await wait_router_ready(session, router, args.recovery_timeout)
    ok, _, loads, _ = await wait_pools_whole(session, dep.urls, None, args.pool_timeout)
    if not ok:
        raise RuntimeError(f"pools not whole before {scenario} rep {rep}: {loads}")
    idle = {n: ld["num_free_blocks"] for n, ld in loads.items()}
    load = Load(session, router, concurrency=args.concurrency, max_tokens=args.max_tokens, deadline=args.deadline,
                chat=args.chat, vocab=args.vocab, conn_errors_clean=scenario == "router",
                seed=100 * SCENARIOS.index(scenario) + rep)
    load.start()
    t_kill = time.monotonic()
    killed = 0
    try:
        await wait_for_condition(lambda: sum(r.outcome == "completed" for r in load.results) >= args.concurrency,
                                 args.recovery_timeout, "requests completing before the kill")
        await asyncio.sleep(args.warmup)
        pd_before = await router_pd_ok(session, router)
        out.loadavg_1m = round(os.getloadavg()[0], 2)
        restarted = None
        if scenario == "router":
            killed = dep.router.pid
            dep.router.kill9()
            t_kill = time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                dep.router.popen.wait(timeout=5)  # reaped (what it left in its group is looked for at the end)
            if args.router_downtime:
                await asyncio.sleep(args.router_downtime)
            await dep.start_router()
            out.restart_healthy_s = time.monotonic() - t_kill
            pd_before = 0.0  # a new router counts from 0
        else:
            name = f"{scenario}0"
            mark = len(dep.launcher.lines)
            killed = dep.pid(name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(killed, signal.SIGKILL)  # the instance's process, as the OOM killer or an operator would
            t_kill = time.monotonic()
            restarted = asyncio.create_task(dep.await_restart(name, mark, args.recovery_timeout))
            waiting = asyncio.create_task(wait_instance(session, dep.urls[name], t_kill, args.recovery_timeout))

        def recovered() -> bool:
            return any(r.start > t_kill and r.outcome == "completed" for r in load.results)

        try:
            await wait_for_condition(recovered, args.recovery_timeout, "a completed request after the kill")
            out.recovery_s = min(r.end for r in load.results if r.start > t_kill and r.outcome == "completed") - t_kill
        except RuntimeError as e:
            out.note += str(e) + "; "
        if restarted is not None:
            try:
                await restarted
            except RuntimeError as e:
                out.note += f"the launcher did not restart the instance: {e}; "
            out.restart_healthy_s, out.restart_serving_s = await waiting
        await asyncio.sleep(args.settle)
        out.pd_after = await router_pd_ok(session, router) > pd_before
        if scenario == "router":
            out.restart_serving_s = out.recovery_s
    finally:
        await load.stop()
    if killed:  # its own process group (the launcher and this script start each process in a new session)
        out.left_behind = group_left(killed)
        killpg(killed, signal.SIGKILL)  # do not let them pile up over the repetitions
    ok, took, loads, first = await wait_pools_whole(session, dep.urls, idle, args.pool_timeout)
    out.pools_whole, out.pools_whole_after_s, out.pools_not_whole_at_stop = ok, round(took, 2), first
    out.pools = {n: {"idle_free": idle[n], "free": (ld or {}).get("num_free_blocks"),
                     "total": (ld or {}).get("num_total_blocks"),
                     "quarantine": ((ld or {}).get("pd") or {}).get("quarantine_blocks")} for n, ld in loads.items()}
    with open(dep.workdir / f"requests_{scenario}_{rep}.jsonl", "w") as fh:  # the timeline, from the kill
        for r in load.results:
            fh.write(json.dumps({**asdict(r), "start": round(r.start - t_kill, 3), "end": round(r.end - t_kill, 3)})
                     + "\n")
    out.sent = len(load.results)
    for r in load.results:
        if r.outcome == "completed":
            out.completed += 1
        elif r.outcome == "clean_error":
            out.clean_errors += 1
            out.errors[r.detail] = out.errors.get(r.detail, 0) + 1
        else:
            out.lost += 1
            out.lost_kinds[r.detail] = out.lost_kinds.get(r.detail, 0) + 1
    ends = [r.end for r in load.results if r.end > t_kill and r.outcome == "completed"]
    out.first_completion_s = min(ends) - t_kill if ends else None
    for k in ("recovery_s", "first_completion_s", "restart_healthy_s", "restart_serving_s"):
        v = getattr(out, k)
        setattr(out, k, None if v is None else round(v, 2))
    return out


async def wait_for_condition(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def run_all(args: argparse.Namespace, workdir: Path, scenarios: list[str], reps: int) -> list[Rep]:
    """Start the deployment, run `reps` repetitions of each scenario, stop everything (also on failure)."""
    dep = Deployment(workdir, args.instance_args, args.router_args, args.startup_timeout)
    results: list[Rep] = []
    try:
        await dep.start()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a killed router leaves no stale keep-alive
        async with aiohttp.ClientSession(connector=connector) as session:
            for scenario in scenarios:
                if scenario == "router" and dep.router is None:
                    await dep.start_router()
                for rep in range(1, reps + 1):
                    r = await run_rep(dep, session, scenario, rep, args)
                    results.append(r)
                    if args.verbose:
                        print(json.dumps(asdict(r)), flush=True)
    finally:
        dep.close()
    return results


# ---------------------------------------------------------------- report


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


COLUMNS = ("| scenario | rep | sent | completed | clean errors | lost | recovery s (kill -> first success) | "
           "restarted instance healthy / serving s | pools whole (s after load stopped) | processes left behind |\n"
           "|---|---|---|---|---|---|---|---|---|---|")
NAMES = {"decode": "kill -9 decode", "prefill": "kill -9 prefill", "router": "kill -9 + restart router"}


def table(reps: list[dict]) -> str:
    rows = [COLUMNS]
    for r in reps:
        restart = "-" if r["scenario"] == "router" else f"{_s(r['restart_healthy_s'])} / {_s(r['restart_serving_s'])}"
        whole = f"yes ({r['pools_whole_after_s']:.1f})" if r["pools_whole"] else "**no**"
        rows.append(f"| {NAMES[r['scenario']]} | {r['rep']} | {r['sent']} | {r['completed']} | {r['clean_errors']} | "
                    f"{r['lost']} | {_s(r['recovery_s'])} | {restart} | {whole} | {len(r['left_behind'])} |")
    return "\n".join(rows)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions of each scenario (default: %(default)s)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--concurrency", type=int, default=4, help="clients sending requests back to back")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds a request may take before it counts as lost")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the kill")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of load after recovery")
    p.add_argument("--recovery-timeout", type=float, default=180.0)
    p.add_argument("--pool-timeout", type=float, default=60.0,
                   help="seconds the pools may take to be whole after the load stops (blocks a dead prefill "
                        "instance was writing stay quarantined up to the KV lease, 30 s by default)")
    p.add_argument("--router-downtime", type=float, default=0.0,
                   help="seconds between killing and restarting the router")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--instance-args", default=shlex.join(INSTANCE_ARGS),
                   help="flags for the instances (default: %(default)s)")
    p.add_argument("--router-args", default=shlex.join(ROUTER_ARGS),
                   help="flags for the routers, the launcher's and the one of its own (default: %(default)s)")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="completions only (models without a chat template)")
    p.add_argument("--vocab", choices=["english", "wordlevel"], default="english",
                   help="prompt words: English, or t<i> for the word-level tokenizer of random-weight models")
    p.add_argument("--out", default=str(OUT_DIR / "kill_table.json"))
    p.add_argument("--workdir", default=None, help="logs of the processes (default: a new temporary directory)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    args.instance_args = shlex.split(args.instance_args)
    args.router_args = shlex.split(args.router_args)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def run(args: argparse.Namespace) -> dict:
    """Every repetition of every scenario; the result as written to --out."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-kill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    reps = asyncio.run(run_all(args, workdir, args.scenarios, args.reps))
    rows = [asdict(r) for r in reps]
    totals = {}
    for s in args.scenarios:
        mine = [r for r in rows if r["scenario"] == s]
        totals[s] = {k: sum(r[k] for r in mine) for k in ("sent", "completed", "clean_errors", "lost")}
        totals[s]["pools_whole"] = all(r["pools_whole"] for r in mine)
        totals[s]["left_behind"] = sum(len(r["left_behind"]) for r in mine)
        rec = [r["recovery_s"] for r in mine if r["recovery_s"] is not None]
        totals[s]["recovery_s_max"] = max(rec) if rec else None
    return {
        "what": "kill tests of a 1P1D deployment (pdserve serve --prefill 1 --decode 1) on CPU",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": "python benchmarks/faults/kill_table.py " + shlex.join(args.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"instance_args": args.instance_args, "router_args": args.router_args,
                     "concurrency": args.concurrency, "max_tokens": args.max_tokens, "deadline_s": args.deadline,
                     "chat": args.chat, "warmup_s": args.warmup, "settle_s": args.settle,
                     "router_downtime_s": args.router_downtime},
        "wall_s": round(time.time() - t0, 1),
        "reps": rows,
        "totals": totals,
        "logs": str(workdir),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    md = table(result["reps"])
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"\nwritten: {out} and {out.with_suffix('.md')}; process logs in {result['logs']}")
    return 0 if all(t["lost"] == 0 and t["pools_whole"] and not t["left_behind"]
                    for t in result["totals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

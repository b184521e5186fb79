"""`pdserve serve --prefill X --decode Y`: a local XpYd deployment in one command.

Starts X prefill and Y decode (and optionally colocated) instances as child processes, on a CUDA host `tp`
consecutive GPUs each (`--device cuda:N`, rank r on N+r; `--prefill-tp` / `--decode-tp` set a role's
tensor-parallel size, by default the instances' `-tp`; all GPUs left visible so cuda_ipc can map peers' pools), waits until every one answers /health,
runs the router in this process, prints where to send requests, and on SIGINT/SIGTERM stops the router and every child (their whole process groups; children also
get SIGTERM from the kernel if this process dies without cleaning up), so nothing is left running.

Instance flags (`--model`, `--max-model-len`, ...) are the instance server's own, mirrored here and passed to every
instance; router tunables are mirrored from RouterConfig.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.envs import cuda_visible_devices
from pdserve.gc_heap import freeze_startup_heap
from pdserve.router.config import RouterConfig
from pdserve.router.main import add_tunable_arguments, build_config

log = logging.getLogger("pdserve.serve")

LAUNCHER_FLAGS = {"--prefill", "--decode", "--both", "--host", "--port", "--role", "-h", "--help"}
STOP_GRACE_S = 15.0  # children get this long after SIGTERM before SIGKILL
RESTART_BACKOFF_S = 1.0  # first restart of a dead instance after this long; doubles for each restart after
RESTART_BACKOFF_MAX_S = 60.0


@dataclass
class Child:
    name: str
    role: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    gpu: str | None = None
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    next_restart: float = 0.0  # monotonic time before which a dead child is not restarted (backoff)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """(Re)start the process; its output is appended to its log."""
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True, preexec_fn=_die_with_parent)


def _add(container: Any, parser: argparse.ArgumentParser, *flags: str, **kw: Any) -> None:
    """add_argument unless the parser already has one of these option strings (`pdserve serve` builds its parser
    from the instance flags and adds --prefill/--decode itself; the launcher then adds only what is missing)."""
    if not any(f in parser._option_string_actions for f in flags):
        container.add_argument(*flags, **kw)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Launcher flags, router tunables and (mirrored) instance flags; options the parser already has are kept."""
    g = parser.add_argument_group("deployment")
    _add(g, parser, "--prefill", type=int, default=0, metavar="X", help="prefill instances to start")
    _add(g, parser, "--decode", type=int, default=0, metavar="Y", help="decode instances to start")
    _add(g, parser, "--both", type=int, default=0, metavar="N", help="colocated instances to start")
    _add(g, parser, "--prefill-tp", type=int, default=None, metavar="TP",
         help="tensor-parallel size of each prefill instance (default: the instances' -tp)")
    _add(g, parser, "--decode-tp", type=int, default=None, metavar="TP",
         help="tensor-parallel size of each decode instance (default: the instances' -tp)")
    _add(g, parser, "--host", default=RouterConfig.host, help="router listen address (default: %(default)s)")
    _add(g, parser, "--port", type=int, default=RouterConfig.port,
         help="router port; 0 picks one (default: %(default)s)")
    _add(g, parser, "--instance-base-port", type=int, default=None,
         help="instance i listens on BASE+i (default: the router's port + 1, or free ports if that is 0)")
    _add(g, parser, "--startup-timeout", type=float, default=900.0,
         help="seconds to wait for every instance's /health (model loading)")
    _add(g, parser, "--log-dir", default=None, help="instance logs (default: a new temporary directory)")
    _add(g, parser, "--instance-command", default=f"{shlex.quote(sys.executable)} -m pdserve.server",
         help="command that starts one instance; --role/--port/--host and the instance flags are appended")
    _add(g, parser, "--no-restart", action="store_true",
         help="leave an instance that died down (default: restart it, with backoff)")
    _add(g, parser, "--isolate-gpus", action="store_true",
         help="start each instance with CUDA_VISIBLE_DEVICES set to its own GPUs, as instances started by hand "
              "usually are (default: every GPU visible, each instance told its own with --device)")
    _add(g, parser, "--allow-gpu-sharing", action="store_true",
         help="more instances than GPUs: share GPUs round-robin instead of refusing")
    _add(g, parser, "--router-config", default=None, metavar="FILE.yaml", help="router settings (pools are ignored)")
    _add(g, parser, "--policy", default=None, help="router: the same policy for every pool")
    r = parser.add_argument_group("router")
    add_tunable_arguments(r, skip=LAUNCHER_FLAGS | set(parser._option_string_actions))
    from pdserve.server.main import add_arguments as add_instance_arguments

    add_instance_arguments(parser, skip=LAUNCHER_FLAGS)  # passed to every instance
    return parser


def _defaults() -> dict[str, Any]:
    return vars(add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([]))


def normalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what a caller's parser did not define (e.g. `pdserve serve`'s) with the launcher's defaults, and apply
    `--router-port` where the caller has it."""
    for name, value in _defaults().items():
        if not hasattr(args, name):
            setattr(args, name, value)
    if getattr(args, "router_port", None) is not None:
        args.port = args.router_port
    return args


def instance_argv(args: argparse.Namespace) -> list[str]:
    """The instance flags the user set, as argv, built from the instance config they make (role, host and port are
    the launcher's own for each instance)."""
    from pdserve.config import KVTransferConfig, ServerConfig
    from pdserve.server.main import build_config as build_instance_config
    from pdserve.server.main import config_argv

    ns = argparse.Namespace(**{**vars(args), "role": KVTransferConfig.role, "host": ServerConfig.host,
                               "port": ServerConfig.port})
    return config_argv(build_instance_config(ns))


def visible_gpus(device: str | None) -> list[str]:
    """GPU ids this process may hand out; empty on a CPU-only host or when instances are told to use the CPU."""
    if device and device.startswith("cpu"):
        return []
    env = cuda_visible_devices()
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except Exception:  # no torch or a broken CUDA install: behave as on CPU
        return []


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec: ask the kernel to SIGTERM the child if the launcher dies (Linux), so no orphans survive."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def plan_children(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(role, name, tensor-parallel size) of every instance to start."""
    for name in ("prefill", "decode", "both"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0")
    if args.decode + args.both == 0:
        raise ValueError("nothing would serve requests: give --decode Y (with --prefill X) or --both N")
    base = getattr(args, "tensor_parallel_size", None) or 1
    tp = {"prefill": args.prefill_tp or base, "decode": args.decode_tp or base, "both": base}
    for role in ("prefill", "decode"):
        given = getattr(args, f"{role}_tp")
        if given is not None and given < 1:
            raise ValueError(f"--{role}-tp must be at least 1")
    return ([("prefill", f"prefill{i}", tp["prefill"]) for i in range(args.prefill)]
            + [("decode", f"decode{i}", tp["decode"]) for i in range(args.decode)]
            + [("both", f"both{i}", tp["both"]) for i in range(args.both)])


def assign_gpus(plan: list[tuple[str, str, int]], num_gpus: int, sharing: bool) -> list[int | None]:
    """The first of each instance's `tp` consecutive GPU slots (None on a CPU host). Without `sharing` every
    instance gets GPUs of its own: they must add up to at most `num_gpus`; with it, slots wrap around."""
    if not num_gpus:
        return [None] * len(plan)
    need = sum(tp for _, _, tp in plan)
    if need > num_gpus and not sharing:
        raise ValueError(f"{len(plan)} instances need {need} GPUs (tensor-parallel sizes "
                         f"{', '.join(str(tp) for _, _, tp in plan)}) but {num_gpus} are visible "
                         "(use fewer instances or --allow-gpu-sharing)")
    slots, nxt = [], 0
    for _, name, tp in plan:
        if tp > num_gpus:
            raise ValueError(f"{name} needs {tp} GPUs; {num_gpus} are visible")
        if nxt + tp > num_gpus:
            nxt = 0
        slots.append(nxt)
        nxt = (nxt + tp) % num_gpus
    return slots


def spawn_children(args: argparse.Namespace, log_dir: Path) -> list[Child]:
    plan = plan_children(args)
    gpus = visible_gpus(getattr(args, "device", None))
    slots = assign_gpus(plan, len(gpus), args.allow_gpu_sharing)
    base = shlex.split(args.instance_command)
    base_port = args.instance_base_port
    if base_port is None:
        base_port = args.port + 1 if args.port else 0
    extra = instance_argv(args)
    threads = max(1, (os.cpu_count() or 1) // sum(tp for _, _, tp in plan))
    children: list[Child] = []
    try:
        for k, ((role, name, tp), slot) in enumerate(zip(plan, slots)):
            port = base_port + k if base_port else free_port()
            env = dict(os.environ)  # with PDSERVE_DEPLOYMENT_SECRET_FILE (write_secret): never on a command line
            gpu = ",".join(gpus[slot:slot + tp]) if slot is not None else None
            device: list[str] = []
            if slot is not None and getattr(args, "isolate_gpus", False):
                # only its own GPUs: cuda_ipc to peers then goes through CUDA VMM pools (--kv-pool-alloc auto)
                env["CUDA_VISIBLE_DEVICES"] = gpu
                device = ["--device", "cuda:0"]
            elif slot is not None:
                # every GPU stays visible and the instance is told which one is its own (rank r on slot + r): peers
                # on other GPUs of the host can then map its KV pool (cuda_ipc), which a CUDA_VISIBLE_DEVICES of
                # its own GPUs only would forbid
                device = ["--device", f"cuda:{slot}"]
            else:  # CPU processes: split the cores instead of every process spinning on all of them
                env.setdefault("OMP_NUM_THREADS", str(threads))
            size = ["--tensor-parallel-size", str(tp)]  # after `extra`: the role's size wins over the instances' -tp
            cmd = [*base, "--role", role, "--host", "127.0.0.1", "--port", str(port), *extra, *size, *device]
            log_path = log_dir / f"{name}.log"
            log_path.write_bytes(b"")
            child = Child(name, role, port, None, log_path, gpu, cmd, env)  # type: ignore[arg-type]
            child.start()
            children.append(child)
    except BaseException:
        stop_children(children)
        raise
    return children


def write_secret(args: argparse.Namespace, log_dir: Path) -> Path:
    """The deployment secret in a file only this user can read: the one given (flag or environment), else a new
    random one. The router (this process) and every instance find it through PDSERVE_DEPLOYMENT_SECRET_FILE, which
    this sets; command lines and environments never carry the secret itself."""
    from pdserve.secret import generate_secret, load_secret

    secret = load_secret(file=getattr(args, "deployment_secret_file", None))
    path = log_dir / "deployment-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret if secret is not None else generate_secret().encode())
    os.environ.pop("PDSERVE_DEPLOYMENT_SECRET", None)
    os.environ["PDSERVE_DEPLOYMENT_SECRET_FILE"] = str(path)
    args.deployment_secret_file = str(path)
    return path


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


async def wait_healthy(children: list[Child], timeout: float, stop: asyncio.Event) -> None:
    """Until every child answers /health 200; raises RuntimeError if one exits or the timeout passes."""
    deadline = time.monotonic() + timeout
    pending = {c.name: c for c in children}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while pending:
            if stop.is_set():
                raise RuntimeError("interrupted while waiting for the instances")
            for child in list(pending.values()):
                if child.proc.poll() is not None:
                    raise RuntimeError(f"instance {child.name} exited with code {child.proc.returncode} during "
                                       f"start-up; last lines of {child.log_path}:\n{_tail(child.log_path)}")
                try:
                    async with session.get(child.url + "/health") as resp:
                        if resp.status == 200:
                            del pending[child.name]
                            print(f"pdserve serve: {child.name} ready at {child.url}", flush=True)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"instances {sorted(pending)} not healthy after {timeout:.0f}s "
                                   f"(logs in {children[0].log_path.parent})")
            if pending:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.25)


def stop_children(children: list[Child], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's process group, wait up to `grace`, then SIGKILL what is left."""
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("instance %s did not stop within %.0fs: killing it", child.name, grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)  # also reaps grandchildren left in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5)


async def _watch(children: list[Child], stop: asyncio.Event, restart: bool = True) -> None:
    """Restart instances that die while serving, with exponential backoff (the router's health checks route around
    them meanwhile and take them back once they answer again)."""
    while not stop.is_set():
        now = time.monotonic()
        for child in children:
            if child.proc.poll() is None:
                continue
            if child.next_restart == 0.0:
                delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** child.restarts)
                child.next_restart = now + delay
                print(f"pdserve serve: instance {child.name} exited with code {child.proc.returncode}; "
                      + (f"restarting it in {delay:.0f} s" if restart else "not restarting it")
                      + f" (log {child.log_path})", file=sys.stderr, flush=True)
            elif restart and now >= child.next_restart:
                child.restarts += 1
                child.next_restart = 0.0
                child.start()
                print(f"pdserve serve: restarted {child.name} (pid {child.proc.pid}, restart {child.restarts})",
                      flush=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)


async def serve(args: argparse.Namespace) -> int:
    from pdserve.router.proxy import bound_port, start_router

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    write_secret(args, log_dir)  # one deployment secret for the router and every instance (signed orders, KV)
    children = spawn_children(args, log_dir)
    for c in children:
        where = f"GPU {c.gpu}" if c.gpu is not None else "CPU"  # "GPU 2,3": a TP=2 instance
        print(f"pdserve serve: started {c.name} (pid {c.proc.pid}, {where}) on {c.url}, log {c.log_path}: "
              f"{shlex.join(c.cmd)}", flush=True)
    runner = None
    try:
        await wait_healthy(children, args.startup_timeout, stop)
        pools = {role: [c.url for c in children if c.role == role] for role in ("prefill", "decode", "both")}
        config: RouterConfig = build_config(args, args.router_config, **pools)
        _, runner = await start_router(config)
        port = bound_port(runner)
        print(f"pdserve serve: ready: send OpenAI requests to http://{config.host}:{port}/v1 "
              f"({args.prefill} prefill, {args.decode} decode, {args.both} colocated); Ctrl-C stops everything",
              flush=True)
        freeze_startup_heap("router")  # this process proxies every request of the deployment
        await _watch(children, stop, not args.no_restart)
        return 0
    except RuntimeError as e:
        print(f"pdserve serve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("pdserve serve: stopping", flush=True)
        if runner is not None:
            await runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, stop_children, children)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    normalize_args(args)
    try:  # fail on bad flags before starting anything (placeholder pools: the real URLs come after start-up)
        plan_children(args)
        build_config(args, args.router_config, prefill=[], decode=["http://127.0.0.1:1"], both=[])
    except (ValueError, OSError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args))
    except ValueError as e:
        print(f"pdserve serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve serve", description=__doc__.split("\n\n")[0])
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

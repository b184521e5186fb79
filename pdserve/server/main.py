"""Command-line flags of an instance (vLLM's names where the meaning is the same) and its serve loop.

Why here and not in cli.py: `pdserve serve`, `pdserve instance` and `python -m pdserve.server` share these
flags and this loop; the CLI only picks a subcommand. Defaults come from the config dataclasses, never from
numbers repeated here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pdserve import envs
from pdserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_FALLBACKS,
    KV_LAYERWISE,
    KV_POOL_ALLOCS,
    KV_PROTOCOLS,
    KV_TRANSPORTS,
    LOAD_FORMATS,
    LOG_LEVELS,
    ROLES,
    TP_ALL_REDUCES,
    EngineConfig,
    KVTransferConfig,
    ServerConfig,
)
from pdserve.gc_heap import freeze_startup_heap
from pdserve.secret import HELP as SECRET_HELP
from pdserve.secret import load_secret
from pdserve.server.body import RUNNER_OPTIONS

log = logging.getLogger("pdserve.server")

# Hundreds of clients connect at once in a benchmark burst; aiohttp's default backlog (128) would make the rest
# retry their SYN a second later.
LISTEN_BACKLOG = 2048
SHUTDOWN_GRACE_S = 10.0  # in-flight requests get this long after SIGINT/SIGTERM before they are cancelled


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


class _Group:
    """An argument group that leaves out flags the parser already has or the caller reserved for itself."""

    def __init__(self, parser: argparse.ArgumentParser, title: str, skip: set[str]):
        self.parser, self.group, self.skip = parser, parser.add_argument_group(title), skip

    def add_argument(self, *flags: str, **kw: Any) -> None:
        if set(flags) & self.skip or any(f in self.parser._option_string_actions for f in flags):
            return
        self.group.add_argument(*flags, **kw)


def add_arguments(parser: argparse.ArgumentParser, skip: set[str] | frozenset[str] = frozenset()
                  ) -> argparse.ArgumentParser:
    """Add every instance flag to `parser` (`pdserve serve`, `pdserve instance`, and mirrored by the launcher),
    except those in `skip` or already defined. Defaults and choices come from the config dataclasses and constants."""
    E, S, K = EngineConfig, ServerConfig, KVTransferConfig
    skip = set(skip)
    m = _Group(parser, "model", skip)
    m.add_argument("--model", default=_default(E, "model"),
                   help="model directory, GGUF file or registered name (default: %(default)s, the embedded Gemma 3 270M)")
    m.add_argument("--tokenizer", default=_default(E, "tokenizer"), help="tokenizer path when it differs from the model's")
    m.add_argument("--served-model-name", default=_default(E, "served_model_name"),
                   help="the name clients send as `model` (default: --model)")
    m.add_argument("--load-format", default=_default(E, "load_format"), choices=LOAD_FORMATS,
                   help="dummy: random weights in the model's shape (benchmarks)")
    m.add_argument("--dtype", default=_default(E, "dtype"), choices=DTYPES)
    m.add_argument("--seed", type=int, default=_default(E, "seed"), help="seed of the engine's default sampler")
    m.add_argument("--max-model-len", type=int, default=_default(E, "max_model_len"),
                   help="context length (default: the model's, capped on CPU)")
    e = _Group(parser, "engine", skip)
    e.add_argument("--device", default=_default(E, "device"), help="auto | cpu | cuda | cuda:N (default: the best present)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=_default(E, "tensor_parallel_size"),
                   help="GPUs (one worker process each) the model is sharded over; rank r uses the device's index + r")
    e.add_argument("--max-num-seqs", type=int, default=_default(E, "max_num_seqs"), help="most requests in one batch")
    e.add_argument("--max-num-batched-tokens", type=int, default=_default(E, "max_num_batched_tokens"),
                   help="most tokens in one engine step")
    e.add_argument("--max-long-prefill-tokens", type=int, default=_default(E, "max_long_prefill_tokens"),
                   help="while requests decode, a step takes at most this many tokens of prompts with more than this "
                        "many left, so a stream of long prompts keeps decode steps short (0: no limit)")
    e.add_argument("--max-waiting", type=int, default=_default(E, "max_waiting"),
                   help="queued requests beyond this get HTTP 503")
    e.add_argument("--gpu-memory-utilization", type=float, default=_default(E, "gpu_memory_utilization"),
                   help="fraction of GPU memory for weights, activations and the KV pool")
    e.add_argument("--cpu-kv-cache-gb", type=float, default=_default(E, "cpu_kv_cache_gb"), help="KV pool size on CPU")
    e.add_argument("--block-size", type=int, default=_default(E, "block_size"), help="tokens per KV block")
    e.add_argument("--num-gpu-blocks", type=int, default=_default(E, "num_gpu_blocks"),
                   help="force the KV pool's size in blocks (tests)")
    e.add_argument("--kv-cache-dtype", default=_default(E, "kv_cache_dtype"), choices=KV_CACHE_DTYPES)
    e.add_argument("--attention-backend", default=_default(E, "attention_backend"), choices=ATTENTION_BACKENDS)
    e.add_argument("--tp-all-reduce", default=_default(E, "tp_all_reduce"), choices=TP_ALL_REDUCES,
                   help="how tensor-parallel ranks sum: nccl, or symm_mem (CUDA: PyTorch symmetric memory for sums "
                        "of up to 8 MiB, NCCL above)")
    e.add_argument("--enforce-eager", action="store_true", default=_default(E, "enforce_eager"),
                   help="no CUDA graphs for decode")
    e.add_argument("--nvtx", action=argparse.BooleanOptionalAction, default=_default(E, "nvtx"),
                   help="NVTX ranges around engine steps, KV transfers and handovers, for Nsight Systems")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_default(E, "enable_prefix_caching"))
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=_default(E, "async_scheduling"),
                   help="schedule the next engine step while the current one runs on the GPU (default: on for CUDA "
                        "devices; never on prefill-role instances)")
    e.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=_default(E, "warmup"),
                   help="run a few requests through the engine at start-up so the first served ones do not compile "
                        "kernels (default: on for CUDA devices)")
    s = _Group(parser, "server", skip)
    s.add_argument("--host", default=_default(S, "host"))
    s.add_argument("--port", type=int, default=_default(S, "port"), help="0 picks a free port (printed when ready)")
    s.add_argument("--role", default=_default(K, "role"), choices=ROLES, help="both: a colocated instance")
    s.add_argument("--request-timeout", type=float, default=_default(S, "request_timeout_s"),
                   help="seconds before a request is aborted with HTTP 504")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--log-level", default=_default(E, "log_level"), choices=LOG_LEVELS)
    s.add_argument("--log-stats-interval", type=float, default=_default(S, "log_stats_interval_s"), metavar="SECONDS",
                   help="log the engine's throughput, step pace, queue and KV cache use this often (0: never)")
    s.add_argument("--disable-log-stats", action="store_true", help="no engine stats line (--log-stats-interval 0)")
    k = _Group(parser, "disaggregation (prefill/decode roles)", skip)
    k.add_argument("--kv-transport", default=_default(K, "transport"), choices=KV_TRANSPORTS,
                   help="how KV blocks move between instances (auto: cuda_ipc within a host, else tcp)")
    k.add_argument("--kv-host", default=_default(K, "host"), help="address the KV agent listens on")
    k.add_argument("--kv-port", type=int, default=_default(K, "port"), help="KV agent port (0: any free port; rank r of a tensor-parallel instance: port + r)")
    k.add_argument("--kv-lease", type=float, default=_default(K, "lease_s"),
                   help="seconds a block may stay held or reserved for a peer before it is reclaimed")
    k.add_argument("--kv-fallback", default=_default(K, "fallback"), choices=KV_FALLBACKS,
                   help="decode role, when no prefill instance delivers the KV: recompute it here or fail the request")
    k.add_argument("--kv-layerwise", default=_default(K, "layerwise"), choices=KV_LAYERWISE,
                   help="prefill role: push each layer's KV while later layers compute (auto: per decode peer, when "
                        "its transport is tcp)")
    k.add_argument("--kv-push-ahead", action=argparse.BooleanOptionalAction, default=_default(K, "push_ahead"),
                   help="prefill role: push each chunk's finished KV blocks of a long prompt while its next chunk "
                        "computes, so only the last chunk's blocks move after the prefill")
    k.add_argument("--kv-pool-alloc", default=_default(K, "pool_alloc"), choices=KV_POOL_ALLOCS,
                   help="the KV pool's GPU memory: vmm (CUDA VMM, shareable over cuda_ipc whatever GPUs each process "
                        "sees), torch, or auto (vmm for prefill/decode roles where the GPU supports it)")
    k.add_argument("--kv-protocol", default=_default(K, "protocol"), choices=KV_PROTOCOLS,
                   help="mooncake transport: rdma or tcp")
    k.add_argument("--kv-devices", default=_default(K, "devices"), metavar="DEV[,DEV]",
                   help="mooncake transport: the RDMA devices to use, e.g. mlx5_0,mlx5_1 (default: every one found)")
    add_access_arguments(_Group(parser, "access and limits (docs/security.md)", skip))
    return parser


# flag dest -> KVTransferConfig field, for the flags whose names differ from the fields
KV_FLAGS = {"role": "role", "kv_transport": "transport", "kv_host": "host", "kv_port": "port", "kv_lease": "lease_s",
            "kv_fallback": "fallback", "kv_layerwise": "layerwise", "kv_push_ahead": "push_ahead",
            "kv_pool_alloc": "pool_alloc",
            "kv_protocol": "protocol", "kv_devices": "devices"}
# flag dest -> ServerConfig field
SERVER_FLAGS = {"host": "host", "port": "port", "request_timeout": "request_timeout_s",
                "max_request_bytes": "max_request_bytes", "body_read_timeout": "body_read_timeout_s",
                "max_prompt_chars": "max_prompt_chars", "tokenizer_workers": "tokenizer_workers",
                "max_queue_wait": "max_queue_wait_s", "log_stats_interval": "log_stats_interval_s"}


def _engine_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name != "kv_transfer"]


def add_access_arguments(a: Any) -> None:
    S = ServerConfig
    a.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` to /v1/*, /tokenize, /detokenize (several "
                        "keys allowed; default: $PDSERVE_API_KEY, else no key needed)")
    a.add_argument("--deployment-secret-file", default=None, metavar="FILE",
                   help="file holding the deployment secret that signs internal requests (default: "
                        "$PDSERVE_DEPLOYMENT_SECRET_FILE, $PDSERVE_DEPLOYMENT_SECRET): signs internal requests and "
                        "authenticates KV agents; a prefill or decode instance needs it")
    a.add_argument("--max-request-bytes", type=int, default=_default(S, "max_request_bytes"),
                   help="larger request bodies get HTTP 413")
    a.add_argument("--body-read-timeout", type=float, default=_default(S, "body_read_timeout_s"),
                   help="seconds a client may take to send its request body (then HTTP 408)")
    a.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompt text gets HTTP 400 without tokenizing (default: max-model-len times the "
                        "longest token in characters)")
    a.add_argument("--tokenizer-workers", type=int, default=_default(S, "tokenizer_workers"),
                   help="processes that tokenize long prompts off the server's event loop (0: threads only)")
    a.add_argument("--max-queue-wait", type=float, default=_default(S, "max_queue_wait_s"),
                   help="seconds a request may wait to start; one that cannot gets HTTP 503 + Retry-After at once "
                        "(0: no limit)")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The client API keys: --api-key, else $PDSERVE_API_KEY, else none (they never go on an instance's argv)."""
    return list(args.api_key) if getattr(args, "api_key", None) else ([envs.api_key()] if envs.api_key() else [])


def build_config(args: argparse.Namespace) -> ServerConfig:
    """Flags -> ServerConfig (raises ValueError with the dataclasses' own message on a bad value)."""
    ns = vars(args)
    secret = load_secret(file=ns.get("deployment_secret_file"))
    if ns["role"] != "both" and secret is None:
        raise ValueError(f"a {ns['role']} instance needs the deployment secret, the same on every instance: "
                         f"{SECRET_HELP}")
    kv = KVTransferConfig(**{field: ns[flag] for flag, field in KV_FLAGS.items()}, secret=secret)
    engine = EngineConfig(**{name: ns[name] for name in _engine_fields()}, kv_transfer=kv)
    server = {}
    for flag, field in SERVER_FLAGS.items():
        # `pdserve serve` shares some flags with the router, whose dest is the field name and default None
        value = ns[flag] if flag in ns else ns.get(field)
        if value is not None:
            server[field] = value
    if ns.get("disable_log_stats"):
        server["log_stats_interval_s"] = 0.0
    return ServerConfig(engine=engine, **server, api_keys=api_keys(args))


def config_argv(config: ServerConfig) -> list[str]:
    """The instance flags that reproduce `config` (only those differing from the defaults): the launcher builds each
    instance's command line from its config with this, never from argparse internals."""
    out: list[str] = []

    def add(flag: str, value: Any, default: Any) -> None:
        if value == default:
            return
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif value is not None:
            out.extend([flag, str(value)])

    base_e, base_k, base_s = EngineConfig(), KVTransferConfig(), ServerConfig()
    for name in _engine_fields():
        flag = "--" + name.replace("_", "-")
        value = getattr(config.engine, name)
        if name == "enforce_eager":  # a store_true flag: no --no- form
            if value:
                out.append(flag)
            continue
        add(flag, value, getattr(base_e, name))
    for flag, field in KV_FLAGS.items():
        add("--" + flag.replace("_", "-"), getattr(config.engine.kv_transfer, field), getattr(base_k, field))
    for flag, field in SERVER_FLAGS.items():
        add("--" + flag.replace("_", "-"), getattr(config, field), getattr(base_s, field))
    return out


ExtraRoutes = Callable[[web.Application], None]


async def serve(config: ServerConfig, extra_routes: ExtraRoutes | None = None, access_log: bool = False) -> int:
    """Start the engine, then HTTP; serve until SIGINT/SIGTERM; shut both down. Returns the exit code."""
    from pdserve.engine.async_llm import AsyncLLM  # loads torch: only when actually serving
    from pdserve.server.app import create_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    from pdserve.disagg.routes import pd_routes as make_pd_routes

    llm = AsyncLLM(config.engine)
    pd_routes = make_pd_routes(llm, config.engine.kv_transfer)

    def routes(app: web.Application) -> None:
        pd_routes(app)
        if extra_routes is not None:
            extra_routes(app)

    try:
        await llm.start()
    except Exception as e:
        print(f"pdserve: the engine failed to start: {e}", file=sys.stderr, flush=True)
        await llm.shutdown()
        return 1
    runner = web.AppRunner(
        create_app(llm, config, routes),
        handler_cancellation=True,  # a client that disconnects cancels its handler, which aborts its request
        **RUNNER_OPTIONS,  # request bodies are decoded by pdserve.server.body
        access_log=log if access_log else None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
        await site.start()
    except OSError as e:
        print(f"pdserve: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr, flush=True)
        await runner.cleanup()
        await llm.shutdown()
        return 1
    if config.role != "both" and config.deployment_secret is None:
        print("pdserve: warning: no deployment secret (PDSERVE_DEPLOYMENT_SECRET or --deployment-secret-file): "
              "this instance refuses every `pd` order, so it cannot take part in disaggregated serving",
              file=sys.stderr, flush=True)
    port = runner.addresses[0][1] if runner.addresses else config.port
    name = getattr(llm, "model_name", None) or config.engine.name
    print(f"pdserve: serving {name} on http://{config.host}:{port} (role {config.role})", flush=True)
    freeze_startup_heap("server")  # serve() runs in a process of its own (`pdserve instance`, the launcher's child)
    try:
        await stop.wait()
    finally:
        print("pdserve: shutting down", flush=True)
        await runner.cleanup()
        await llm.shutdown()
    return 0


def run_loop(coro):
    """asyncio.run, on uvloop where it is installed (the GPU image has it): fewer microseconds per token."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    uvloop.install()
    return asyncio.run(coro)


def run(args: argparse.Namespace, extra_routes: ExtraRoutes | None = None) -> int:
    """Serve one instance from parsed flags until SIGINT/SIGTERM; the exit code for sys.exit."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ValueError as e:
        print(f"pdserve: invalid configuration: {e}", file=sys.stderr)
        return 2
    try:
        return run_loop(serve(config, extra_routes, args.access_log))
    except KeyboardInterrupt:
        return 0

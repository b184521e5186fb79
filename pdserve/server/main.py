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
from pdserve.config import EngineConfig, ServerConfig
from pdserve.server.auth import read_secret_file, secret_bytes
from pdserve.server.body import RUNNER_OPTIONS

log = logging.getLogger("pdserve.server")

# Hundreds of clients connect at once in a benchmark burst; aiohttp's default backlog (128) would make the rest
# retry their SYN a second later.
LISTEN_BACKLOG = 2048
SHUTDOWN_GRACE_S = 10.0  # in-flight requests get this long after SIGINT/SIGTERM before they are cancelled


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every instance flag to `parser` (also used by `pdserve serve` and `pdserve instance`)."""
    E, S = EngineConfig, ServerConfig
    m = parser.add_argument_group("model")
    m.add_argument(
        "--model",
        default=_default(E, "model"),
        help="model directory, GGUF file or registered name (default: %(default)s, the embedded Gemma 3 270M)",
    )
    m.add_argument("--tokenizer", default=None, help="tokenizer path when it differs from the model's")
    m.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    m.add_argument(
        "--load-format",
        default=_default(E, "load_format"),
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy: random weights in the model's shape (benchmarks)",
    )
    m.add_argument("--dtype", default=_default(E, "dtype"), choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("--seed", type=int, default=_default(E, "seed"), help="seed of the engine's default sampler")
    m.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's, capped on CPU)"
    )
    e = parser.add_argument_group("engine")
    e.add_argument(
        "--device", default=_default(E, "device"), help="auto | cpu | cuda | cuda:N (default: the best present)"
    )
    e.add_argument("--max-num-seqs", type=int, default=_default(E, "max_num_seqs"), help="most requests in one batch")
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_default(E, "max_num_batched_tokens"),
        help="most tokens in one engine step",
    )
    e.add_argument(
        "--max-waiting", type=int, default=_default(E, "max_waiting"), help="queued requests beyond this get HTTP 503"
    )
    e.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_default(E, "gpu_memory_utilization"),
        help="fraction of GPU memory for weights, activations and the KV pool",
    )
    e.add_argument("--cpu-kv-cache-gb", type=float, default=_default(E, "cpu_kv_cache_gb"), help="KV pool size on CPU")
    e.add_argument("--block-size", type=int, default=_default(E, "block_size"), help="tokens per KV block")
    e.add_argument("--num-gpu-blocks", type=int, default=None, help="force the KV pool's size in blocks (tests)")
    e.add_argument("--kv-cache-dtype", default=_default(E, "kv_cache_dtype"))
    e.add_argument("--attention-backend", default=_default(E, "attention_backend"), choices=["auto", "torch", "triton"])
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    e.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=_default(E, "enable_prefix_caching")
    )
    s = parser.add_argument_group("server")
    s.add_argument("--host", default=_default(S, "host"))
    s.add_argument("--port", type=int, default=_default(S, "port"), help="0 picks a free port (printed when ready)")
    s.add_argument(
        "--role", default=_default(S, "role"), choices=["prefill", "decode", "both"], help="both: a colocated instance"
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=_default(S, "request_timeout_s"),
        help="seconds before a request is aborted with HTTP 504",
    )
    k = parser.add_argument_group("disaggregation (prefill/decode roles)")
    k.add_argument("--kv-transport", default=_default(E, "kv_transport"), choices=["auto", "tcp", "cuda_ipc", "nixl"],
                   help="how KV blocks move between instances (auto: cuda_ipc within a host, else tcp)")
    k.add_argument("--kv-host", default=_default(E, "kv_host"), help="address the KV agent listens on")
    k.add_argument("--kv-port", type=int, default=_default(E, "kv_port"), help="KV agent port (0: any free port)")
    k.add_argument("--kv-lease", type=float, default=_default(E, "kv_lease_s"),
                   help="seconds a block may stay held or reserved for a peer before it is reclaimed")
    k.add_argument("--kv-fallback", default=_default(E, "kv_fallback"), choices=["recompute", "fail"],
                   help="decode role, when no prefill instance delivers the KV: recompute it here or fail the request")
    k.add_argument("--kv-layerwise", default=_default(E, "kv_layerwise"), choices=["auto", "on", "off"],
                   help="prefill role: push each layer's KV while later layers compute (auto: when the transport is tcp)")
    a = parser.add_argument_group("access and limits (docs/security.md)")
    add_access_arguments(a)
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def add_access_arguments(a: Any) -> None:
    S = ServerConfig
    a.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` to /v1/*, /tokenize, /detokenize (several "
                        "keys allowed; default: $PDSERVE_API_KEY, else no key needed)")
    a.add_argument("--deployment-secret-file", default=None, metavar="FILE",
                   help="file holding the deployment secret that signs internal requests (default: "
                        "$PDSERVE_DEPLOYMENT_SECRET); an instance honours `pd` orders only when signed with it")
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


def access_config(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig fields from the access flags (validated)."""
    keys = list(args.api_key) if args.api_key else ([envs.api_key()] if envs.api_key() else [])
    secret = read_secret_file(args.deployment_secret_file)
    secret_bytes(secret)  # refuses a secret too short to be safe
    if args.max_request_bytes < 1024:
        raise ValueError(f"max request bytes must be at least 1024, got {args.max_request_bytes}")
    if args.body_read_timeout <= 0:
        raise ValueError(f"body read timeout must be positive, got {args.body_read_timeout}")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ValueError(f"max prompt chars must be positive, got {args.max_prompt_chars}")
    if args.tokenizer_workers < 0 or args.max_queue_wait < 0:
        raise ValueError("tokenizer workers and max queue wait must not be negative")
    return dict(api_keys=keys, deployment_secret=secret, max_request_bytes=args.max_request_bytes,
                body_read_timeout_s=args.body_read_timeout, max_prompt_chars=args.max_prompt_chars,
                tokenizer_workers=args.tokenizer_workers, max_queue_wait_s=args.max_queue_wait)


def build_config(args: argparse.Namespace) -> ServerConfig:
    """Flags -> ServerConfig (raises ValueError with the dataclasses' own message on a bad value)."""
    engine = EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_role=args.role,
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_lease_s=args.kv_lease,
        kv_fallback=args.kv_fallback,
        kv_layerwise=args.kv_layerwise,
    )
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {args.port}")
    if args.request_timeout <= 0:
        raise ValueError(f"request timeout must be positive, got {args.request_timeout}")
    return ServerConfig(
        host=args.host, port=args.port, engine=engine, role=args.role, request_timeout_s=args.request_timeout,
        **access_config(args),
    )


ExtraRoutes = Callable[[web.Application], None]


async def serve(config: ServerConfig, extra_routes: ExtraRoutes | None = None, access_log: bool = False) -> int:
    """Start the engine, then HTTP; serve until SIGINT/SIGTERM; shut both down. Returns the exit code."""
    from pdserve.engine.async_llm import AsyncLLM  # loads torch: only when actually serving
    from pdserve.server.app import create_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    from pdserve.disagg.instance import pd_extra_routes

    config.engine.kv_role = config.role  # prefill/decode instances run a KV transfer agent in the engine process
    llm = AsyncLLM(config.engine)
    pd_routes = pd_extra_routes(llm, config.role)

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

"""`pdserve router` / `python -m pdserve.router`: flags, YAML, and the serve loop.

Flags for the tunables are generated from RouterConfig's fields (`kv_beta` -> `--kv-beta`), so a new knob needs
no flag code and defaults live only in the dataclass; a flag given on the command line wins over the YAML file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from typing import Any

from pdserve.gc_heap import freeze_startup_heap
from pdserve.router.config import ROLES, RouterConfig

log = logging.getLogger("pdserve.router")

HELP = {
    "prefill_policy": "ranking of prefill instances (round_robin | least_loaded | kv_aware)",
    "decode_policy": "ranking of decode instances",
    "both_policy": "ranking of colocated (both) instances when there is no decode pool",
    "kv_alpha": "KV-aware score weight of a cached prompt token",
    "kv_beta": "KV-aware score weight of a queued or running token",
    "local_prefill_max_tokens": "prefill on the decode instance when the uncached prompt is at most this many tokens",
    "prefill_max_waiting_tokens": "a prefill instance with more queued tokens than this takes no new prefill: "
                                  "the decode instance prefills the prompt (0: never; the default)",
    "max_prefill_candidates": "prefill URLs handed to the decode instance (best first, the rest fallbacks)",
    "max_inflight_per_instance": "requests the router keeps outstanding at one decode instance",
    "max_waiting_per_instance": "a decode instance reporting more waiting requests than this is full",
    "max_queue": "requests the router queues while every decode instance is full; beyond: 503",
    "queue_timeout_s": "seconds a request may wait in the router queue before 503",
    "retry_after_s": "Retry-After seconds on 503",
    "health_interval_s": "seconds between /load polls",
    "health_timeout_s": "timeout of one /load poll",
    "breaker_failures": "consecutive failures that take an instance out",
    "breaker_cooldown_s": "seconds an instance stays out before it is probed again",
    "max_decode_retries": "other decode instances tried when one fails before answering",
    "read_timeout_s": "longest silence tolerated from an upstream",
    "prefix_chunk_chars": "characters per chunk of the router's prefix hashes",
    "prefix_cache_chunks": "prefix chunks remembered per instance (LRU)",
    "chars_per_token": "characters per token in the router's token estimates",
    "startup_wait_s": "seconds the router waits for its first health poll round",
    "connect_timeout_s": "timeout of connecting to an instance",
    "abort_timeout_s": "timeout of the best-effort POST /v1/abort",
    "max_request_bytes": "larger request bodies get HTTP 413",
    "body_read_timeout_s": "seconds a client may take to send its request body (then HTTP 408)",
}
ACCESS = {"api_keys", "instance_api_key", "deployment_secret"}  # secrets: their own flags, env fallbacks
EXCLUDED = set(ROLES) | {"host", "port"} | ACCESS


def _flag(name: str) -> str:
    return "--" + name.removesuffix("_s").replace("_", "-") if name.endswith("_s") else "--" + name.replace("_", "-")


def tunable_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RouterConfig) if f.name not in EXCLUDED]


def add_tunable_arguments(parser: argparse.ArgumentParser | Any, skip: set[str] = frozenset()) -> list[str]:
    """Add one flag per RouterConfig tunable (default None = take the file's or the dataclass's value).
    Returns the dests added; flags whose option string is in `skip` are left out."""
    added = []
    for f in tunable_fields():
        flag = _flag(f.name)
        if flag in skip:
            continue
        kind = type(f.default)
        parser.add_argument(flag, dest=f.name, type=kind, default=None, metavar=kind.__name__.upper(),
                            help=f"{HELP.get(f.name, f.name.replace('_', ' '))} (default: {f.default})")
        added.append(f.name)
    return added


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="prefill instances (http://host:port)")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL", help="decode instances")
    parser.add_argument("--both", nargs="+", action="extend", default=[], metavar="URL",
                        help="colocated instances (serve whole requests)")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="router settings and pools; flags given here win over the file")
    parser.add_argument("--policy", default=None, help="shorthand: the same policy for every pool")
    parser.add_argument("--host", default=None, help=f"listen address (default: {RouterConfig.host})")
    parser.add_argument("--port", type=int, default=None, help=f"listen port (default: {RouterConfig.port})")
    add_tunable_arguments(parser)
    add_access_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def add_access_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The router's credentials (names and meaning shared with the instance flags, so `pdserve serve` passes the
    same values to both)."""
    parser.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                        help="clients must send `Authorization: Bearer KEY` to /v1/*, /tokenize, /detokenize "
                             "(default: $PDSERVE_API_KEY, else no key needed)")
    parser.add_argument("--instance-api-key", default=None, metavar="KEY",
                        help="the key the router sends to instances (default: its own first key)")
    parser.add_argument("--deployment-secret-file", default=None, metavar="FILE",
                        help="file holding the deployment secret the router signs `pd` orders and aborts with "
                             "(default: $PDSERVE_DEPLOYMENT_SECRET_FILE, $PDSERVE_DEPLOYMENT_SECRET); needed to disaggregate")


def access_values(args: argparse.Namespace) -> dict[str, Any]:
    """api_keys, instance_api_key and deployment_secret from flags, else the environment (None: not given)."""
    from pdserve import envs
    from pdserve.secret import load_secret

    keys = getattr(args, "api_key", None) or ([envs.api_key()] if envs.api_key() else None)
    return {"api_keys": list(keys) if keys else None,
            "instance_api_key": getattr(args, "instance_api_key", None),
            "deployment_secret": load_secret(file=getattr(args, "deployment_secret_file", None))}


def build_config(args: argparse.Namespace, config_path: str | None = None, **extra: Any) -> RouterConfig:
    """Flags (+ the YAML file at `config_path`) -> RouterConfig; `extra` wins over both. Raises ValueError with a
    readable message."""
    values: dict[str, Any] = {f.name: getattr(args, f.name, None) for f in tunable_fields()}
    if getattr(args, "policy", None):
        for name in ("prefill_policy", "decode_policy", "both_policy"):
            values[name] = values[name] or args.policy
    for role in ROLES:
        urls = getattr(args, role, None)
        values[role] = list(urls) if isinstance(urls, list) and urls else None
    values["host"] = getattr(args, "host", None)
    values["port"] = getattr(args, "port", None)
    values.update(access_values(args))
    values.update(extra)
    if config_path:
        return RouterConfig.from_yaml(config_path, **values)
    return RouterConfig.from_dict({k: v for k, v in values.items() if v is not None})


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or `stop` is set)."""
    from pdserve.router.proxy import bound_port, start_router

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        router, runner = await start_router(config)
    except OSError as e:
        print(f"pdserve router: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr, flush=True)
        return 1
    pools = ", ".join(f"{role}: {len(getattr(config, role))}" for role in ROLES if getattr(config, role))
    print(f"pdserve router: serving on http://{config.host}:{bound_port(runner)} ({pools})", flush=True)
    freeze_startup_heap("router")
    try:
        await stop.wait()
    finally:
        print("pdserve router: shutting down", flush=True)
        await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args, args.config)
    except (ValueError, OSError) as e:
        print(f"pdserve router: invalid configuration: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0

"""Router configuration: the instance pools, the routing policies and every limit and timeout, in one dataclass.

Why one flat dataclass: the same values come from flags (`pdserve router --prefill ...`) or from a YAML file
(`--config router.yaml`), and tests build it directly; one place validates them so a bad value fails at start-up
with a message instead of misbehaving under load.

A YAML file uses the field names below; every key is optional except a decode (or both) pool:

    prefill: [http://10.0.0.1:8001, http://10.0.0.2:8001]
    decode: [http://10.0.0.3:8002]
    host: 0.0.0.0
    port: 8000
    prefill_policy: kv_aware
    local_prefill_max_tokens: 256
    max_queue: 2048
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

ROLES = ("prefill", "decode", "both")


POLICY_NAMES = ("round_robin", "least_loaded", "kv_aware")  # pdserve.router.policies registers exactly these


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`, so pools and `pd.prefill_urls` compare equal."""
    url = url.strip()
    if not url:
        raise ValueError("empty instance URL")
    if "://" not in url:
        url = "http://" + url
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
        raise ValueError(f"instance URL must look like http://host:port, got {url!r}")
    return f"{parsed.scheme}://{parsed.netloc}".rstrip("/")


@dataclass
class RouterConfig:
    """Everything the router needs. Token counts are *estimates* from characters (the router is model-agnostic
    and does not tokenize): `chars_per_token` converts."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    both: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000

    # policies (POLICY_NAMES; pdserve.router.policies implements each)
    prefill_policy: str = "kv_aware"
    decode_policy: str = "least_loaded"
    both_policy: str = "least_loaded"
    kv_alpha: float = 1.0  # weight of a cached-prefix token in the KV-aware score
    kv_beta: float = 0.5  # weight of a queued/running token of load in the KV-aware score
    prefix_chunk_chars: int = 64  # chunk size of the router's prefix hash chain (~16 tokens of English)
    prefix_cache_chunks: int = 65536  # LRU capacity per instance of remembered chunk hashes
    chars_per_token: float = 4.0

    # conditional disaggregation
    local_prefill_max_tokens: int = 64  # uncached prompt (estimated tokens) at or below this: prefill on decode
    # a prefill instance with more queued tokens than this is "full", and a prompt no prefill instance takes is
    # prefilled on its decode instance; 0: never full. Off by default: in a burst the decode instance then runs the
    # prompts' prefill chunks between its decode steps, which stalls every stream it serves (docs/design.md,
    # "Where the prompt is prefilled"; measured in benchmarks/lease_s25/pd_policy)
    prefill_max_waiting_tokens: int = 0
    max_prefill_candidates: int = 3  # ordered prefill URLs handed to the decode instance (best + fallbacks)

    # admission
    max_inflight_per_instance: int = 512  # router-side cap on requests outstanding at one decode/both instance
    max_waiting_per_instance: int = 1024  # an instance reporting more waiting requests than this is "full"
    max_queue: int = 1024  # requests the router holds while every instance is full; beyond: 503
    queue_timeout_s: float = 30.0  # a request queued this long gets 503
    retry_after_s: int = 1

    # health and circuit breaking
    health_interval_s: float = 0.2
    health_timeout_s: float = 1.0
    breaker_failures: int = 3  # consecutive failures (polls or requests) that open an instance's breaker
    breaker_cooldown_s: float = 5.0  # open -> half-open after this; one probe then decides
    startup_wait_s: float = 5.0  # at start, wait this long for the first poll round before serving

    # upstream requests
    max_decode_retries: int = 2  # other decode instances tried when one fails before sending a response
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence tolerated from an upstream (a long queue + prefill)
    abort_timeout_s: float = 1.0  # best-effort POST /v1/abort on client disconnect / decode death

    # access and limits (docs/security.md)
    api_keys: list[str] = field(default_factory=list)  # clients must send one as a bearer token (empty: none)
    instance_api_key: str | None = None  # the key sent to instances (default: the router's first key)
    deployment_secret: str | bytes | None = None  # signs the `pd` orders and aborts sent to instances (needed for PD)
    max_request_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    body_read_timeout_s: float = 30.0  # a body not fully received within this gets 408

    def __post_init__(self) -> None:
        self.prefill = [normalize_url(u) for u in self.prefill]
        self.decode = [normalize_url(u) for u in self.decode]
        self.both = [normalize_url(u) for u in self.both]
        seen: dict[str, str] = {}
        for role in ROLES:
            for url in getattr(self, role):
                if url in seen:
                    raise ValueError(f"instance {url} listed twice (as {seen[url]} and as {role})")
                seen[url] = role
        if not self.decode and not self.both:
            raise ValueError("the router needs at least one decode or both instance (--decode URL or --both URL)")
        for name in ("prefill_policy", "decode_policy", "both_policy"):
            value = getattr(self, name)
            if value not in POLICY_NAMES:
                raise ValueError(f"{name}={value!r} is not one of {sorted(POLICY_NAMES)}")
        positive = [
            "prefix_chunk_chars", "prefix_cache_chunks", "chars_per_token", "max_prefill_candidates",
            "max_inflight_per_instance", "health_interval_s", "health_timeout_s", "breaker_failures",
            "breaker_cooldown_s", "connect_timeout_s", "read_timeout_s", "abort_timeout_s", "queue_timeout_s",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        non_negative = [
            "kv_alpha", "kv_beta", "local_prefill_max_tokens", "prefill_max_waiting_tokens",
            "max_waiting_per_instance", "max_queue", "retry_after_s", "startup_wait_s", "max_decode_retries",
        ]
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if isinstance(self.api_keys, str):
            self.api_keys = [self.api_keys]
        if not isinstance(self.api_keys, list) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError("api_keys must be a list of non-empty strings")
        from pdserve.secret import as_secret

        as_secret(self.deployment_secret)  # refuses a secret too short to be safe
        if self.max_request_bytes < 1024 or self.body_read_timeout_s <= 0:
            raise ValueError("max_request_bytes must be at least 1024 and body_read_timeout_s positive")

    @property
    def upstream_api_key(self) -> str | None:
        """The bearer token the router sends to instances."""
        return self.instance_api_key or (self.api_keys[0] if self.api_keys else None)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterConfig:
        """Build from a mapping (parsed YAML); unknown keys are an error so typos do not pass silently."""
        if not isinstance(data, dict):
            raise ValueError(f"router config must be a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown router config keys {unknown}; known: {sorted(names)}")
        data = dict(data)
        for role in ROLES:
            value = data.get(role)
            if value is None:
                data.pop(role, None)
            elif isinstance(value, str):
                data[role] = [value]
            elif not isinstance(value, list) or not all(isinstance(u, str) for u in value):
                raise ValueError(f"{role} must be a list of URLs, got {value!r}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> RouterConfig:
        """Load a YAML file; `overrides` (e.g. flags given on the command line) win over the file."""
        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    def role_of(self, url: str) -> str:
        url = normalize_url(url)
        for role in ROLES:
            if url in getattr(self, role):
                return role
        raise KeyError(url)

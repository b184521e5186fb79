"""Configuration of a transfer agent (one per process), with the defaults in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.config import KV_TRANSPORTS as TRANSPORTS
from pdserve.envs import kv_cuda_streams

CUDA_COPY_METHODS = ("auto", "batch", "kernel", "percopy")


@dataclass
class AgentConfig:
    """How an agent listens, which transport it prefers, and how long anything may wait.

    Every wait in the engine is bounded by one of the timeouts below, so a dead or stalled peer becomes an error.
    """

    name: str | None = None  # unique per agent; defaults to host-pid-random
    host: str = "127.0.0.1"  # listen address ("0.0.0.0" for multi-host)
    port: int = 0  # 0 picks a free port
    advertise_host: str | None = None  # address peers should dial, if different from `host`
    transport: str = "auto"  # auto | tcp | cuda_ipc | nixl
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 10.0  # longest a single socket operation may stall before the transfer fails
    transfer_timeout_s: float = 120.0  # default deadline of one transfer
    # parallel data connections per peer: more than the cores only adds contention (measured: 2 beat 4 on 2 cores)
    tcp_connections: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    tcp_stripe_min_bytes: int = 4 << 20  # transfers smaller than this use one connection
    tcp_socket_buffer: int = 4 << 20
    tcp_staging_bytes: int = 8 << 20  # pinned staging chunk for GPU memory over tcp
    cuda_copy: str = "auto"  # auto | batch (cuMemcpyBatchAsync) | kernel (Triton) | percopy (one copy per run)
    # batched copies split over this many streams, so several copy engines work at once
    cuda_streams: int = field(default_factory=kv_cuda_streams)
    metadata: str = "p2p"  # p2p | etcd
    etcd_url: str = "http://127.0.0.1:2379"
    etcd_prefix: str = "/pdserve/kv/agents/"
    etcd_ttl_s: int = 30
    max_queued_notifications: int = 65536

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {self.transport!r}")
        if self.cuda_copy not in CUDA_COPY_METHODS:
            raise ValueError(f"cuda_copy must be one of {', '.join(CUDA_COPY_METHODS)}; got {self.cuda_copy!r}")
        if self.metadata not in ("p2p", "etcd"):
            raise ValueError(f"metadata must be p2p or etcd; got {self.metadata!r}")
        for k in ("connect_timeout_s", "io_timeout_s", "transfer_timeout_s"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive")
        if self.cuda_streams < 1:
            raise ValueError("cuda_streams must be at least 1")
        if self.tcp_connections < 1:
            raise ValueError("tcp_connections must be at least 1")

"""Configuration of a transfer agent (one per process), with the defaults in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.config import KV_OPT_IN_TRANSPORTS as OPT_IN_TRANSPORTS
from pdserve.config import KV_PROTOCOLS as PROTOCOLS
from pdserve.config import KV_TRANSPORTS as TRANSPORTS
from pdserve.envs import kv_cuda_streams
from pdserve.secret import check_secret

CUDA_COPY_METHODS = ("auto", "batch", "kernel", "percopy")
NCCL_BACKENDS = ("auto", "nccl", "gloo")  # auto: nccl for CUDA pools, gloo for host memory


@dataclass
class AgentConfig:
    """How an agent listens, which transport it prefers, and how long anything may wait.

    Every wait in the engine is bounded by one of the timeouts below, so a dead or stalled peer becomes an error.
    """

    name: str | None = None  # unique per agent; defaults to host-pid-random
    host: str = "127.0.0.1"  # listen address ("0.0.0.0" for multi-host)
    port: int = 0  # 0 picks a free port
    advertise_host: str | None = None  # address peers should dial, if different from `host`
    transport: str = "auto"  # auto | tcp | cuda_ipc | nixl | mooncake | nccl
    # opt-in transports (mooncake, nccl) to start beside the automatic ones: usable by naming them per transfer
    # (`transport=`), never picked by auto (the transfer benchmark's `--transport all` uses this)
    extra_transports: tuple[str, ...] = ()
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
    # ---- mooncake (--kv-devices, --kv-protocol): Mooncake Transfer Engine's own configuration, no code patch ----
    devices: str = ""  # RDMA devices Mooncake may use, comma-separated ("mlx5_0,mlx5_1"); "" = every one it finds
    protocol: str = "rdma"  # rdma | tcp: what Mooncake moves bytes over (rdma with no device is an error, not tcp)
    # ---- nccl: a 2-rank torch.distributed communicator per connected pair ----
    nccl_backend: str = "auto"  # auto (nccl for CUDA pools, gloo for host memory) | nccl | gloo
    nccl_setup_timeout_s: float = 60.0  # creating a pair's communicator (NCCL init) may take this long

    # ---- security (README, "Security"): who may connect, and what a connected peer may touch ----
    secret: bytes | None = field(default=None, repr=False)  # the deployment secret every agent proves; never sent
    # no secret: accept any peer and skip grants (the old, open behaviour; only for tests of transfer mechanics)
    insecure: bool = False
    # authenticated peers may read and write every registered region without grants (benchmarks; never serving)
    open_access: bool = False
    # HMAC the payload bytes of tcp transfers too (a core per ~1-2 GB/s); headers and descriptors always are
    mac_payload: bool = False
    tls_cert: str | None = None  # PEM certificate: control connections use TLS (both sides must set it)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # PEM CA bundle peers' certificates are verified against (None: encrypt, no check)
    tls_check_hostname: bool = False  # also match the peer's certificate to the host dialled
    max_grant_s: float = 3600.0  # a grant's deadline may lie at most this far ahead (catches clock mix-ups)
    max_grants: int = 65536  # live grant keys at most; grant() fails beyond
    # ---- bounds on the KV port: nothing a peer (or anyone) sends can make the agent hold unbounded resources ----
    max_connections: int = 1024  # open incoming connections in total (handshaking or authenticated)
    max_connections_per_peer: int = 64  # authenticated incoming connections of one peer (control + data)
    max_pending_handshakes: int = 128  # beyond this the oldest unauthenticated connection is dropped
    handshake_timeout_s: float = 5.0  # an incoming connection not authenticated by then is closed
    data_idle_timeout_s: float = 300.0  # an authenticated data connection idle this long is closed
    max_descs_per_transfer: int = 1 << 16  # descriptors in one request; more is refused before allocating
    max_frame_bytes: int = 16 << 20  # largest control frame accepted (region tables, NIXL metadata)
    max_notif_bytes: int = 1 << 20  # largest notification payload
    tcp_server_threads: int = 8  # threads copying between sockets and memory for incoming tcp requests
    nvtx: bool = False  # NVTX ranges around every transfer (both sides), when CUDA is available

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {self.transport!r}")
        self.extra_transports = tuple(self.extra_transports)
        bad = [t for t in self.extra_transports if t not in OPT_IN_TRANSPORTS]
        if bad:
            raise ValueError(f"extra_transports may name only {', '.join(OPT_IN_TRANSPORTS)}; got {bad}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {self.protocol!r}")
        if self.nccl_backend not in NCCL_BACKENDS:
            raise ValueError(f"nccl_backend must be one of {', '.join(NCCL_BACKENDS)}; got {self.nccl_backend!r}")
        if self.nccl_setup_timeout_s <= 0:
            raise ValueError("nccl_setup_timeout_s must be positive")
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
        if self.secret is not None:
            if isinstance(self.secret, str):
                raise ValueError("secret must be bytes (pdserve.secret.load_secret turns text into bytes)")
            self.secret = check_secret(self.secret)
            if self.insecure:
                raise ValueError("insecure=True contradicts a configured secret; set one or the other")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        for k in ("handshake_timeout_s", "data_idle_timeout_s", "max_grant_s"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive")
        for k in ("max_connections", "max_connections_per_peer", "max_pending_handshakes", "max_descs_per_transfer",
                  "max_frame_bytes", "max_notif_bytes", "tcp_server_threads", "max_grants"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be at least 1")

    @property
    def access_control(self) -> bool:
        """Whether incoming transfers and notifications are checked against grants."""
        return not (self.insecure or self.open_access)

    def wants(self, transport: str) -> bool:
        """Whether this agent should start `transport`: automatic ones unless another is forced, opt-in ones only
        when forced or listed in extra_transports."""
        if transport in OPT_IN_TRANSPORTS:
            return self.transport == transport or transport in self.extra_transports
        return self.transport in ("auto", transport)

    @property
    def device_list(self) -> list[str]:
        return [d.strip() for d in self.devices.split(",") if d.strip()]

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

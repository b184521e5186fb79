"""Every environment variable pdserve reads, in one module, each with its default and meaning.

Flags and config dataclasses are the main way to configure pdserve; environment variables cover what must reach
processes started by others (CUDA_VISIBLE_DEVICES-style) or secrets that should not appear on a command line.
Read them through these functions (at call time, so tests can monkeypatch the environment).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`PDSERVE_CACHE_DIR`: where converted models, tokenizers and the default model's files are cached
    (default `~/.cache/pdserve`)."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def kv_cuda_streams(default: int = 4) -> int:
    """`PDSERVE_KV_CUDA_STREAMS`: streams a batched cuda_ipc copy is split over (measured best on 2xH200: 4)."""
    return int(os.environ.get("PDSERVE_KV_CUDA_STREAMS", str(default)))


def gc_freeze() -> bool:
    """`PDSERVE_GC_FREEZE`: 0 keeps Python's collector scanning a serving process's start-up heap (default 1: the
    engine, its workers, the server and the router freeze it once ready; pdserve.gc_heap)."""
    return os.environ.get("PDSERVE_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off")


def git_commit_override() -> str | None:
    """`PDSERVE_GIT_COMMIT`: the commit benchmark records name when the tree was copied without `.git`."""
    return os.environ.get("PDSERVE_GIT_COMMIT") or None


def openai_api_key() -> str | None:
    """`OPENAI_API_KEY`: the key `pdserve bench` sends when none is given (as OpenAI's clients do)."""
    return os.environ.get("OPENAI_API_KEY") or None


def cuda_visible_devices() -> str | None:
    """`CUDA_VISIBLE_DEVICES`: the GPUs this process may use (the launcher splits them among instances)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def api_key() -> str | None:
    """`PDSERVE_API_KEY`: the API key clients must send (`Authorization: Bearer <key>`) to an instance's or the
    router's /v1 routes when no --api-key is given; the router also forwards it to instances by default."""
    return os.environ.get("PDSERVE_API_KEY") or None


def deployment_secret() -> str | None:
    """`PDSERVE_DEPLOYMENT_SECRET`: the one secret the processes of a deployment share (at least 16 bytes): it signs
    internal HTTP requests (the router's `pd` orders, decode-to-prefill orders) and KV agents prove it to each other
    (pdserve.kv.secret). Prefer `PDSERVE_DEPLOYMENT_SECRET_FILE` where a process's environment is visible to others."""
    return os.environ.get("PDSERVE_DEPLOYMENT_SECRET") or None


def deployment_secret_file() -> str | None:
    """`PDSERVE_DEPLOYMENT_SECRET_FILE`: path of a file holding the deployment secret (read when no secret is given)."""
    return os.environ.get("PDSERVE_DEPLOYMENT_SECRET_FILE") or None


def skinny_config_file() -> str | None:
    """`PDSERVE_SKINNY_CONFIG`: a JSON file {"N,K[,m1]" | "default": {block_n, block_k, num_warps, num_stages, kind}}
    of the skinny linear kernel's tiles (pdserve.ops.linear) for few-row products on CUDA: what
    `benchmarks/engine/bench_linear.py --best-out FILE` measured best on this GPU."""
    return os.environ.get("PDSERVE_SKINNY_CONFIG") or None


def split_k_config_file() -> str | None:
    """`PDSERVE_SPLIT_K_CONFIG`: a JSON file {"N,K": [[first_row, last_row, parts], ...]} of the products split over K
    with their partial sums left to the next add+RMSNorm (pdserve.ops.split_k): what
    `benchmarks/engine/bench_split_k.py --table-out FILE` measured on this GPU."""
    return os.environ.get("PDSERVE_SPLIT_K_CONFIG") or None


def prefill_library() -> str:
    """`PDSERVE_PREFILL_LIBRARY`: `auto` (default) runs long prefill rows through cuDNN's fused attention where the
    GPU and torch have it (pdserve.ops.attention.library_prefill says which rows and why); `none` keeps every row
    on the Triton kernel."""
    v = os.environ.get("PDSERVE_PREFILL_LIBRARY", "auto").strip().lower() or "auto"
    if v not in ("auto", "none"):
        raise ValueError(f"PDSERVE_PREFILL_LIBRARY must be auto or none, got {v!r}")
    return v


def prefill_library_min_chunk(default: int) -> int:
    """`PDSERVE_PREFILL_LIBRARY_MIN_CHUNK`: the fewest new tokens of a chunk on a prefix that cuDNN's prefill takes
    when its call shapes have no plan yet (default: library_prefill.MIN_CHUNK; an A/B knob for benchmarks, read once
    at import)."""
    v = int(os.environ.get("PDSERVE_PREFILL_LIBRARY_MIN_CHUNK", str(default)))
    if v < 1:
        raise ValueError(f"PDSERVE_PREFILL_LIBRARY_MIN_CHUNK must be positive, got {v}")
    return v


def prefill_library_fp8(default: bool) -> bool:
    """`PDSERVE_PREFILL_LIBRARY_FP8`: `1` / `0` sends long prefill rows over an fp8 pool to cuDNN too, or not
    (default: library_prefill.FP8_POOLS; an A/B knob for serving benchmarks, read once at import)."""
    v = os.environ.get("PDSERVE_PREFILL_LIBRARY_FP8", "").strip().lower()
    if not v:
        return default
    if v not in ("0", "1"):
        raise ValueError(f"PDSERVE_PREFILL_LIBRARY_FP8 must be 0 or 1, got {v!r}")
    return v == "1"


def prefill_config_file() -> str | None:
    """`PDSERVE_PREFILL_CONFIG`: a JSON file ({block_m, block_n, num_warps, num_stages[, g_pack]}) whose tiles replace
    the prefill attention kernel's default choice for bf16/fp16 models with head dim <= 128 on CUDA: what
    `benchmarks/attention/bench_attention.py --sweep --best-out FILE` measured best on this GPU."""
    return os.environ.get("PDSERVE_PREFILL_CONFIG") or None

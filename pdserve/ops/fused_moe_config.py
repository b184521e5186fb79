"""Tile configurations of the fused MoE kernels: a tuned table per (E, N, K, dtype, device) when one is shipped,
looked up by token count, else defaults that are sensible on Hopper.

E = experts, N = the experts' intermediate size (I), K = the hidden size (H). Both GEMMs share BLOCK_M, the row
padding of `moe_align`; each has its own N/K tiles, grouping, warps and pipeline stages. Tables are JSON files under
`pdserve/ops/configs/fused_moe/`, written by benchmarks/moe/tune_fused_moe.py:

    {"key": {"E": 128, "N": 768, "K": 2048, "dtype": "bfloat16", "device": "NVIDIA H200"}, "top_k": 8,
     "configs": {"1": {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 32, ...}, "down": {...}}, "2": ..., "4096": ...}}

A token count takes the smallest tuned bucket at or above it (the largest past the end); a table tuned for another
top_k is not used.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs" / "fused_moe"
_SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles a default may use (Hopper has 227 KiB per block)


@dataclass(frozen=True)
class GemmTile:
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoEKernelConfig:
    BLOCK_M: int
    gate_up: GemmTile
    down: GemmTile

    def to_dict(self) -> dict:
        return {"BLOCK_M": self.BLOCK_M, "gate_up": asdict(self.gate_up), "down": asdict(self.down)}

    @classmethod
    def from_dict(cls, d: dict) -> MoEKernelConfig:
        return cls(int(d["BLOCK_M"]), GemmTile(**d["gate_up"]), GemmTile(**d["down"]))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(E: int, N: int, K: int, dtype: torch.dtype, device_name: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype_name(dtype)},device={device_name.replace(' ', '_')}.json"


@dataclass(frozen=True)
class TunedTable:
    top_k: int | None  # the routing the table was tuned for (rows per expert = tokens * top_k / E)
    configs: dict[int, MoEKernelConfig]


@functools.lru_cache(maxsize=64)
def load_table(path: str) -> TunedTable | None:
    p = Path(path)
    if not p.exists():
        return None
    with open(p) as f:
        data = json.load(f)
    configs = {int(k): MoEKernelConfig.from_dict(v) for k, v in data["configs"].items()}
    return TunedTable(data.get("top_k"), configs) if configs else None


def pick_bucket(table: dict[int, MoEKernelConfig], num_tokens: int) -> MoEKernelConfig:
    at_or_above = [b for b in table if b >= num_tokens]
    return table[min(at_or_above) if at_or_above else max(table)]


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _tile_bytes(block_m: int, t: GemmTile, n_operands: int, elem: int) -> int:
    return t.num_stages * (block_m * t.BLOCK_K + n_operands * t.BLOCK_K * t.BLOCK_N) * elem


def _fit(block_m: int, t: GemmTile, n_operands: int, elem: int) -> GemmTile:
    """Fewer stages, then a shorter K tile, until the pipelined tiles fit the shared-memory budget."""
    while _tile_bytes(block_m, t, n_operands, elem) > _SMEM_BUDGET:
        if t.num_stages > 2:
            t = replace(t, num_stages=t.num_stages - 1)
        elif t.BLOCK_K > 32:
            t = replace(t, BLOCK_K=t.BLOCK_K // 2)
        else:
            break
    return t


def default_config(E: int, N: int, K: int, dtype: torch.dtype, num_tokens: int, top_k: int) -> MoEKernelConfig:
    """Untuned defaults from the mean rows per expert: decode-sized batches touch each expert with a row or two
    (weight-bound: small BLOCK_M, narrow N tiles for more programs, long K tiles); prefill batches give every expert
    many rows (compute-bound: large tiles, grouped ordering for L2 reuse of the expert's weights)."""
    rows_per_expert = num_tokens * top_k / E
    if rows_per_expert < 12:
        cfg = MoEKernelConfig(16, GemmTile(32, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    elif rows_per_expert < 24:
        cfg = MoEKernelConfig(32, GemmTile(64, 128, 1, 4, 3), GemmTile(128, 128, 1, 4, 3))
    elif rows_per_expert < 48:
        cfg = MoEKernelConfig(64, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4))
    else:
        cfg = MoEKernelConfig(128, GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))
    elem = torch.empty((), dtype=dtype).element_size()
    return MoEKernelConfig(cfg.BLOCK_M, _fit(cfg.BLOCK_M, cfg.gate_up, 2, elem), _fit(cfg.BLOCK_M, cfg.down, 1, elem))


def get_config(E: int, N: int, K: int, dtype: torch.dtype, num_tokens: int, top_k: int,
               device: torch.device) -> MoEKernelConfig:
    """The tuned config for this shape on this device if a table is shipped, else the defaults."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        table = load_table(str(CONFIG_DIR / config_file_name(E, N, K, dtype, _device_name(index))))
        if table is not None and table.top_k in (None, top_k):
            return pick_bucket(table.configs, num_tokens)
    return default_config(E, N, K, dtype, num_tokens, top_k)

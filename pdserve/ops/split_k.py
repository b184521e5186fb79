"""Products split over K whose partial sums the next kernel adds: o_proj and down_proj of a decode step of a few
hundred rows, summed by the add+RMSNorm after them.

At 128-384 rows the o and down projections of an 8B model leave most SMs idle: cuBLAS tiles the [rows, 4096]
output into a few dozen tiles (or splits K itself and runs a reduction kernel after). Computing x @ W^T as `s`
products over K's slices in one strided-batched GEMM (views of x and W, no copies) gives s times the tiles; cuBLAS
writes each product's float32 accumulators unrounded into `PartialSums.parts` [s, rows, N], and the add+RMSNorm
that follows every such product in a pre-norm decoder reads the s parts instead of one bf16 output, sums them in
float32 and rounds once to the model's dtype, as the single product would have (pdserve.ops.norm). No extra kernel
and no extra rounding: only the summation order within float32 differs.

Where it pays is measured per GPU: a table of (N, K) -> row ranges and split counts, written by
benchmarks/engine/bench_split_k.py (the product plus its add+RMSNorm, split against not, at every row count a decode
or mixed graph runs), shipped under configs/split_k/ or named by PDSERVE_SPLIT_K_CONFIG. Without an entry, rows on
CPU, a bias, or tensor parallelism (the ranks' outputs are summed by an all-reduce first): the plain product.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from pdserve import envs
from pdserve.ops.dispatch import use_fused
from pdserve.ops.linear import linear

CONFIG_DIR = Path(__file__).parent / "configs" / "split_k"
MAX_PARTS = 4  # K slices a table may ask for
NORM_MAX_PARTS = 8  # parts the add+RMSNorm kernel adds (unrolled): these, or a MoE layer's top-k (Qwen3-30B-A3B's 8)


@dataclass(frozen=True)
class PartialSums:
    """x @ W^T as float32 partial products over K: `parts` [s, rows, N]; their sum, rounded to `dtype`, is the
    product (also a MoE layer's rows of its top-k experts, in the model's dtype: pdserve.ops.fused_moe). Only the
    add+RMSNorm kernels take one (pdserve.ops.norm); `total()` materializes it elsewhere."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def total(self) -> torch.Tensor:
        return self.parts.sum(0, dtype=torch.float32).to(self.dtype)


def materialize(x: torch.Tensor | PartialSums) -> torch.Tensor:
    return x.total() if isinstance(x, PartialSums) else x


@lru_cache(maxsize=8)
def _load_table(path: str) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for key, ranges in raw.items():
        if key.startswith("_"):  # "_source": provenance
            continue
        n, k = (int(v) for v in key.split(","))
        table[(n, k)] = [(int(lo), int(hi), int(s)) for lo, hi, s in ranges]
    return table


@lru_cache(maxsize=8)
def _device_table(device_index: int) -> dict:
    name = torch.cuda.get_device_name(device_index).replace(" ", "_")
    path = CONFIG_DIR / f"device={name}.json"
    return _load_table(str(path)) if path.is_file() else {}


def parts_in(table: dict, n: int, k: int, m: int) -> int | None:
    """The split count a table gives an [m, k] @ [n, k]^T product (1: not split); None without an (n, k) entry."""
    if (n, k) not in table:
        return None
    for lo, hi, s in table[(n, k)]:
        if lo <= m <= hi and 1 < s <= MAX_PARTS and k % s == 0:
            return s
    return 1


@lru_cache(maxsize=4096)
def _parts(n: int, k: int, m: int, device_index: int, path: str | None) -> int:
    """split_parts' lookup, once per (shape, rows): an eager step asks for every layer's products."""
    found = parts_in(_load_table(path), n, k, m) if path else None
    if found is None:
        found = parts_in(_device_table(device_index), n, k, m)
    return found or 1


def split_parts(n: int, k: int, m: int, device: torch.device) -> int:
    """How many K slices an [m, k] @ [n, k]^T product takes on `device` (1: the plain product). Tables, first with
    an (n, k) entry wins: PDSERVE_SPLIT_K_CONFIG's file, then the one shipped for this GPU."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _parts(n, k, m, index, envs.split_k_config_file())


def split_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> PartialSums:
    """x [m, k] @ weight [n, k]^T as `parts` float32 products over K's slices, in one strided-batched GEMM."""
    m, k = x.shape
    n = weight.shape[0]
    ks = k // parts
    xs = x.as_strided((parts, m, ks), (ks, x.stride(0), 1), x.storage_offset())
    ws = weight.as_strided((parts, ks, n), (ks, 1, weight.stride(0)), weight.storage_offset())
    if x.is_cuda and x.dtype != torch.float32:  # cuBLAS writes its float32 accumulators unrounded
        return PartialSums(torch.bmm(xs, ws, out_dtype=torch.float32), x.dtype)
    return PartialSums(torch.bmm(xs.float(), ws.float()), x.dtype)  # no bmm.dtype on CPU (the tests' path)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A product split_linear may take: a 2-D CUDA input (no autograd), row-major x and weight of one dtype."""
    return (x.dim() == 2 and use_fused(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear_parts(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | PartialSums:
    """x @ weight^T, as PartialSums where the measured table splits this (N, K) at x's row count, else a tensor
    (pdserve.ops.linear.linear)."""
    if _enabled and usable(x, weight):
        s = split_parts(weight.shape[0], weight.shape[1], x.shape[0], x.device)
        if s > 1:
            return split_linear(x, weight, s)
    return linear(x, weight)


_enabled = True


def set_split_k(enabled: bool) -> bool:
    """Split the products the table names (default), or never (an A/B in one process); returns the previous
    setting."""
    global _enabled
    prev, _enabled = _enabled, enabled
    return prev

"""Random paged-attention problems for the kernel tests: a pool with shuffled block tables, a batch of rows (decode
rows, whole prompts, chunks on a prefix), their slots and metadata, and the comparison the tests share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdserve.ops.attention import AttentionMetadata, AttentionMetadataBuilder
from pdserve.ops.attention.common import is_fp8
from pdserve.ops.attention.torch_ref import quantize_fp8, write_kv

HAS_CUDA = torch.cuda.is_available()


def gpu(fn):
    """Marks a test `gpu` and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(fn))


DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# relative-error bounds by the dtype the kernel computes in
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Problem:
    pool: torch.Tensor  # [num_blocks, layers, 2, bs, Hk, D]
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]
    slots: np.ndarray
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def kv_layer(self) -> torch.Tensor:
        return self.pool[:, self.layer]

    def fresh_layer(self) -> torch.Tensor:
        """A copy of the pool (same strides as the real pool's layer view) for one backend to write into."""
        return self.pool.clone()[:, self.layer]


def make_problem(seq_lens: list[int], q_lens: list[int], *, hq: int, hk: int, d: int, bs: int,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None, seed: int = 0,
                 device: torch.device = DEVICE, layers: int = 2, spare_blocks: int = 5,
                 qkv_fused: bool = True, builder: AttentionMetadataBuilder | None = None,
                 pad: dict | None = None, write_new: bool = False) -> Problem:
    """Rows i has seq_lens[i] KV tokens after the step, the last q_lens[i] of them new. Blocks are handed out from a
    shuffled list; the pool is random everywhere (stale values in unused slots must never be read). write_new: the
    new tokens' k/v are written into the pool's layer (quantized for fp8 pools), as a backend's forward does before
    attending, so that k/v are the step's own K/V of what the pool holds."""
    assert len(seq_lens) == len(q_lens) and all(0 < q <= s for q, s in zip(q_lens, seq_lens))
    kv_dtype = kv_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-s // bs) for s in seq_lens)
    nb = need + spare_blocks
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[used: used + n])
        used += n
    shape = (nb, layers, 2, bs, hk, d)
    k_scale = v_scale = None
    if is_fp8(kv_dtype):
        k_scale = torch.tensor(0.5 + torch.rand((), generator=g).item(), dtype=torch.float32)
        v_scale = torch.tensor(0.5 + torch.rand((), generator=g).item(), dtype=torch.float32)
        pool = quantize_fp8(torch.randn(shape, generator=g), kv_dtype, torch.tensor(1.0))
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
        pool = pool.to(device)
    else:
        pool = torch.randn(shape, generator=g).to(device, kv_dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    t = int(qsl[-1])
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    row = np.repeat(np.arange(len(seq_lens)), q_lens)
    table_arr = np.full((len(seq_lens), max(len(x) for x in tables)), -1, dtype=np.int64)
    for i, tb in enumerate(tables):
        table_arr[i, : len(tb)] = tb
    slots = table_arr[row, pos // bs] * bs + pos % bs
    if qkv_fused:  # q, k, v as views of one projection output, as the model layers produce them
        qkv = torch.randn((t, (hq + 2 * hk) * d), generator=g).to(device, dtype)
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    else:
        q, k, v = (torch.randn((t, h, d), generator=g).to(device, dtype) for h in (hq, hk, hk))
    builder = builder or AttentionMetadataBuilder(device, max(t, 1), len(seq_lens), table_arr.shape[1])
    meta = builder.build(qsl, np.asarray(seq_lens), tables, slots, **(pad or {}))
    if pad:  # padded token rows get inputs too (the kernels must ignore them)
        tp = meta.slot_mapping.shape[0]
        extra = [torch.randn((tp - t, h, d), generator=g).to(device, dtype) for h in (hq, hk, hk)]
        q, k, v = (torch.cat([x, e]) for x, e in zip((q, k, v), extra))
    p = Problem(pool, layers - 1, q, k, v, meta, tables, slots, k_scale, v_scale)
    if write_new:
        write_kv(p.kv_layer, k, v, meta.slot_mapping, k_scale, v_scale)
    return p


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten or poisoned rows)"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def row_kinds(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Token rows of decode rows (one new token) and of prefill rows (more)."""
    qsl = meta.query_start_loc
    dec, pre = [], []
    for i in range(len(qsl) - 1):
        (dec if qsl[i + 1] - qsl[i] == 1 else pre).extend(range(qsl[i], qsl[i + 1]))
    return dec, pre

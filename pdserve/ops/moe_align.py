"""Group routed rows by expert for the fused MoE GEMMs ("moe align block size"), on the device, without host syncs.

A routing decision `topk_ids [T, K]` names K experts per token; flat row r = t * K + k is token t's k-th choice.
The grouped GEMMs process BLOCK_M rows of one expert per program, so the rows are sorted by expert and each
expert's run is padded up to a multiple of BLOCK_M:

- `sorted_ids [max_rows]` int32: flat rows grouped by expert (any order inside a group), padding = T * K;
- `expert_ids [max_blocks]` int32: the expert of each BLOCK_M block, -1 for blocks past the end;
- `num_rows [1]` int32: rows in use, the sum over experts of count rounded up to BLOCK_M.

Output sizes depend only on (T * K, E, BLOCK_M): at most min(E, T * K) experts are non-empty, each adds fewer than
BLOCK_M padding rows, so `max_rows = roundup(T * K + min(E, T * K) * (BLOCK_M - 1), BLOCK_M)`. A CUDA graph captured
for T tokens therefore replays for any routing.

Up to ONE_PROGRAM_PAIRS routed rows (decode steps), one Triton program does it all: a histogram of the ids, the
padded offsets and block -> expert table, the rows sorted by (expert, row) and stored at their slots, the padding
written around them; rows in a group keep ascending order, as the oracle's. Above that, three kernels: count rows
per expert (atomics), one program turns counts into padded offsets and the block table, then every row takes its
slot (an atomic cursor per expert; any order inside a group), after two fills of the outputs. `moe_align_ref` is
the torch oracle (stable order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton: the torch path serves
    triton = None


@dataclass
class AlignedRows:
    sorted_ids: torch.Tensor  # [max_rows] int32
    expert_ids: torch.Tensor  # [max_blocks] int32
    num_rows: torch.Tensor  # [1] int32
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


# routed rows (tokens x top-k) up to which one program groups them all: on an H200 it beat the three kernels up
# to 64 tokens at top-8 and lost from 128 (benchmarks/moe/bench_route.py, lease_s35/s35e)
ONE_PROGRAM_PAIRS = 512
ONE_PROGRAM_MIN_BLOCK = 128  # its row vector's least size: fewer sizes to compile (one for 1..16 tokens at top-8)


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded rows for `num_pairs` = T * K routed rows over `num_experts` experts."""
    n = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-n // block_m) * block_m


if triton is not None:

    @triton.jit(do_not_specialize=["num_pairs"])
    def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        tl.atomic_add(counts_ptr + e, 1, mask=mask)

    @triton.jit
    def _block_table(expert_ids_ptr, end_blocks, e_ok, total_blocks, max_blocks, BLOCK_B: tl.constexpr):
        for b0 in range(0, max_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            # the expert of block b is the number of experts whose run ends at or before it
            owner = tl.sum(((end_blocks[None, :] <= b[:, None]) & e_ok[None, :]).to(tl.int32), 1)
            owner = tl.where(b < total_blocks, owner, -1)
            tl.store(expert_ids_ptr + b, owner, mask=b < max_blocks)

    @triton.jit(do_not_specialize=["max_blocks"])
    def _offsets_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, num_rows_ptr, num_experts, max_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        e_ok = e < num_experts
        counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(cursor_ptr + e, ends - padded, mask=e_ok)
        total = tl.sum(padded, 0)
        tl.store(num_rows_ptr, total)
        _block_table(expert_ids_ptr, ends // BLOCK_M, e_ok, total // BLOCK_M, max_blocks, BLOCK_B)

    @triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
    def _align_one_program_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_rows_ptr, num_pairs, num_experts,
                                  max_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                                  BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):
        j = tl.arange(0, BLOCK_N)
        ok = j < num_pairs
        e = tl.load(ids_ptr + j, mask=ok, other=0)
        ok = ok & (e >= 0) & (e < num_experts)
        x = tl.arange(0, BLOCK_E)
        e_ok = x < num_experts
        counts = tl.histogram(e, BLOCK_E, mask=ok)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        total = tl.sum(padded, 0)
        tl.store(num_rows_ptr, total)
        _block_table(expert_ids_ptr, ends // BLOCK_M, e_ok, total // BLOCK_M, max_blocks, BLOCK_B)
        # rows sorted by (expert, row): the k-th of the sorted rows lands at k plus the padding before its expert
        key = tl.sort(tl.where(ok, e * BLOCK_N + j, BLOCK_E * BLOCK_N))
        expert = tl.minimum(key // BLOCK_N, BLOCK_E - 1)
        shift = starts - (tl.cumsum(counts, 0) - counts)
        slot = j + tl.gather(shift, expert, 0)
        tl.store(sorted_ptr + slot, key % BLOCK_N, mask=key < BLOCK_E * BLOCK_N)
        # the padding: each expert's run past its rows, then everything past the last run
        for i in range(BLOCK_M - 1):
            pos = starts + counts + i
            tl.store(sorted_ptr + pos, num_pairs, mask=e_ok & (pos < ends))
        max_rows_ = max_blocks * BLOCK_M
        for r0 in range(0, max_rows_, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            tl.store(sorted_ptr + r, num_pairs, mask=(r >= total) & (r < max_rows_))

    @triton.jit(do_not_specialize=["num_pairs"])
    def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        slot = tl.atomic_add(cursor_ptr + e, 1, mask=mask)
        tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=mask)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRows:
    """The Triton path: sizes from shapes only, every value computed on the device."""
    if triton is None:
        raise RuntimeError("moe_align needs Triton; use moe_align_ref")
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    n = ids.numel()
    dev = ids.device
    rows = max_rows(n, num_experts, block_m)
    if n <= ONE_PROGRAM_PAIRS:
        sorted_ids = torch.empty((rows,), dtype=torch.int32, device=dev)
        expert_ids = torch.empty((rows // block_m,), dtype=torch.int32, device=dev)
        num_rows = torch.empty((1,), dtype=torch.int32, device=dev)
        _align_one_program_kernel[(1,)](
            ids, sorted_ids, expert_ids, num_rows, n, num_experts, rows // block_m, BLOCK_M=block_m,
            BLOCK_N=max(triton.next_power_of_2(n), ONE_PROGRAM_MIN_BLOCK),
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64, BLOCK_R=256, num_warps=4)
        return AlignedRows(sorted_ids, expert_ids, num_rows, block_m)
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=dev)
    expert_ids = torch.empty((rows // block_m,), dtype=torch.int32, device=dev)
    num_rows = torch.empty((1,), dtype=torch.int32, device=dev)
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=dev)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    block = 256
    grid = (triton.cdiv(n, block),)
    _count_kernel[grid](ids, counts, n, BLOCK=block)
    _offsets_kernel[(1,)](counts, cursor, expert_ids, num_rows, num_experts, rows // block_m, BLOCK_M=block_m,
                          BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64)
    _scatter_kernel[grid](ids, cursor, sorted_ids, n, BLOCK=block)
    return AlignedRows(sorted_ids, expert_ids, num_rows, block_m)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRows:
    """Torch oracle: same sizes and padding, rows of a group in ascending order."""
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    rows = max_rows(n, num_experts, block_m)
    sorted_ids = torch.full((rows,), n, dtype=torch.int32)
    expert_ids = torch.full((rows // block_m,), -1, dtype=torch.int32)
    counts = torch.bincount(ids.cpu(), minlength=num_experts).tolist()
    order = torch.argsort(ids.cpu(), stable=True).to(torch.int32)
    src = dst = 0
    for e, c in enumerate(counts):
        sorted_ids[dst:dst + c] = order[src:src + c]
        padded = -(-c // block_m) * block_m
        expert_ids[dst // block_m:(dst + padded) // block_m] = e
        src += c
        dst += padded
    dev = topk_ids.device
    return AlignedRows(sorted_ids.to(dev), expert_ids.to(dev), torch.tensor([dst], dtype=torch.int32, device=dev),
                       block_m)

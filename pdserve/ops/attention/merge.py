"""Merging two attention results over disjoint key sets by their log-sum-exps (natural log, of the scaled scores):
out = (o1 * e^(l1 - m) + o2 * e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m)), m = max(l1, l2), in fp32.

`merge_two` is one Triton kernel that reads both partial outputs ([H, L, D], any strides with D contiguous) and
their log-sum-exps ([H, L]) and writes the merged rows straight into an [L, H, D] output (the attention output's
rows of one sequence); `merge_two_reference` is the torch oracle it is tested against. A side whose keys were all
masked has l = -inf and weight 0; rows with both sides empty get 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.dispatch import use_fused

# rows a program and its warps: on an H200 the best of 3 x 3 launches over the 32k prompt's chunks and two shorter rows,
# and 2.3x faster than (32, 4) without the outputs' alignment (an 8192-token chunk: 123.7 -> 52.9 us a layer,
# 90 % of the copy rate; benchmarks/lease_s43/s43a, bench_merge.py)
BLOCK_T = 16
NUM_WARPS = 4


# one binary whatever a chunk's length and where its rows start in the causal call's output (L's divisibility and the
# log-sum-exp slice's alignment vary with the step's decode rows): session 28's server compiled a second one while
# serving, for a chunk whose length was a multiple of 16 after the warm-up had met one that was not. The outputs'
# pointers (O1, O2, Out) are specialized on their 16-byte alignment, which the row's views always have (rows of whole
# heads: an offset of rows x H x D or rows x D 16-bit values, D a multiple of 8), so Triton moves 16 bytes a load;
# with no pointer specialized it moved 2 and the kernel ran at 39 % of the copy rate (s43a)
@triton.jit(do_not_specialize=["L"], do_not_specialize_on_alignment=["L1", "L2"])
def _merge_two_kernel(O1, L1, O2, L2, Out, L,
                      s_o1h, s_o1t, s_o2h, s_o2t, s_l1h, s_l1t, s_l2h, s_l2t, s_ot, s_oh,
                      D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tm = t < L
    m2 = tm[:, None] & (d < D)[None, :]
    l1 = tl.load(L1 + h * s_l1h + t * s_l1t, mask=tm, other=float("-inf")).to(tl.float32)
    l2 = tl.load(L2 + h * s_l2h + t * s_l2t, mask=tm, other=float("-inf")).to(tl.float32)
    m = tl.maximum(l1, l2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(l1 - m)
    w2 = tl.exp(l2 - m)
    tot = w1 + w2
    inv = tl.where(tot > 0.0, 1.0 / tl.where(tot > 0.0, tot, 1.0), 0.0)
    o1 = tl.load(O1 + h * s_o1h + t[:, None] * s_o1t + d[None, :], mask=m2, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + h * s_o2h + t[:, None] * s_o2t + d[None, :], mask=m2, other=0.0).to(tl.float32)
    o = o1 * (w1 * inv)[:, None] + o2 * (w2 * inv)[:, None]
    tl.store(Out + t[:, None] * s_ot + h * s_oh + d[None, :], o.to(Out.dtype.element_ty), mask=m2)


def merge_two_reference(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """[H, L, D] x2 and [H, L] x2 -> the merged [L, H, D] in o1's dtype (computed in fp32)."""
    l1, l2 = l1.float(), l2.float()
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    tot = w1 + w2
    inv = torch.where(tot > 0, 1.0 / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.zeros_like(tot))
    o = o1.float() * (w1 * inv).unsqueeze(-1) + o2.float() * (w2 * inv).unsqueeze(-1)
    return o.transpose(0, 1).to(o1.dtype)


def merge_two(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, out: torch.Tensor) -> None:
    """Write the merge of (o1, l1) and (o2, l2) (o: [H, L, D], l: [H, L]) into out ([L, H, D])."""
    h, n, d = o1.shape
    if o2.shape != o1.shape or l1.shape != (h, n) or l2.shape != (h, n) or out.shape != (n, h, d):
        raise ValueError(f"merge_two: o {tuple(o1.shape)}/{tuple(o2.shape)}, l {tuple(l1.shape)}/{tuple(l2.shape)}, "
                         f"out {tuple(out.shape)}")
    if o1.stride(-1) != 1 or o2.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("merge_two needs a contiguous last dimension")
    if not use_fused(o1):
        out.copy_(merge_two_reference(o1, l1, o2, l2))
        return
    launch(_merge_two_kernel, o1, l1, o2, l2, out, BLOCK_T, NUM_WARPS)


def launch(kernel, o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, out: torch.Tensor,
           block_t: int, num_warps: int) -> None:
    """One launch of `kernel` (_merge_two_kernel, or a variant of it built by benchmarks/attention/bench_merge.py) on
    checked inputs: a program per head and block_t rows."""
    h, n, d = o1.shape
    kernel[(h, triton.cdiv(n, block_t))](
        o1, l1, o2, l2, out, n,
        o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1), l1.stride(0), l1.stride(1), l2.stride(0),
        l2.stride(1), out.stride(0), out.stride(1),
        D=d, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(d), num_warps=num_warps)

"""A MoE router's softmax, top-k and renormalisation in one Triton kernel.

`route_topk(logits, k, renormalize)` returns what `pdserve.model.moe.softmax_topk` (the torch oracle) returns:
the k largest softmax probabilities of each token's router logits, in float32 and in descending order, with their
expert ids as int32; renormalised to sum to 1 when asked (Qwen3-MoE's norm_topk_prob, Mixtral).

Why: in torch that is a softmax, a top-k (two kernels), a sum, a division and an int32 copy, six launches a MoE
layer for a handful of numbers a token; session 35's kernel profile of Qwen3-30B-A3B's decode steps
(benchmarks/lease_s35/) has them among the largest of the step's small kernels at one row.

One program takes BLOCK_T tokens' logits [BLOCK_T, E] into registers and picks the k largest one by one (ties go
to the lower expert id). The weights need no softmax over all experts when renormalised: softmax(l)_i / sum over
the chosen j of softmax(l)_j = exp(l_i - m) / sum over the chosen j of exp(l_j - m); without renormalising, the
sum runs over all experts. A logit row with NaNs still yields ids in [0, E) (the expert layer's row grouping
indexes by them); which experts and weights it gets is left open (the torch path gives NaN weights).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton: the torch path serves
    triton = None

BLOCK_T = 4  # tokens a program: [4, 128] float32 logits of Qwen3-30B-A3B's 128 experts in registers


if triton is not None:

    @triton.jit(do_not_specialize=["T"])
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t,
                      K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                      RENORM: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        x = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_t + e[None, :],
                    mask=t_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)
        m = tl.max(x, 1)
        kk = tl.arange(0, K_PAD)
        p_k = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
        id_k = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
        cur = x
        for k in tl.static_range(K):
            best = tl.max(cur, 1)
            # the lowest expert id holding the best value; a NaN row matches nothing and is clamped into range
            idx = tl.min(tl.where(cur == best[:, None], e[None, :], BLOCK_E), 1)
            idx = tl.minimum(idx, E - 1)
            p_k = tl.where(kk[None, :] == k, tl.exp(best - m)[:, None], p_k)
            id_k = tl.where(kk[None, :] == k, idx[:, None], id_k)
            cur = tl.where(e[None, :] == idx[:, None], float("-inf"), cur)
        if RENORM:
            denom = tl.sum(p_k, 1)  # the unused K_PAD - K columns hold 0
        else:
            denom = tl.sum(tl.where(e_ok[None, :], tl.exp(x - m[:, None]), 0.0), 1)
        w = p_k / denom[:, None]
        out = t[:, None].to(tl.int64) * K + kk[None, :]
        ok = t_ok[:, None] & (kk[None, :] < K)
        tl.store(weights_ptr + out, w, mask=ok)
        tl.store(ids_ptr + out, id_k, mask=ok)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of softmax_topk: (weights float32 [T, k], expert ids int32 [T, k]), one launch."""
    if triton is None:
        raise RuntimeError("route_topk needs Triton; use pdserve.model.moe.softmax_topk")
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(router_logits.shape)}")
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in 1..{E}, got {top_k}")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    _route_kernel[(triton.cdiv(T, BLOCK_T),)](
        logits, weights, ids, T, E, logits.stride(0),
        K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), BLOCK_T=BLOCK_T,
        RENORM=bool(renormalize), num_warps=4,
    )
    return weights, ids

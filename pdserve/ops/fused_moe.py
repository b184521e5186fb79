"""Fused mixture-of-experts MLP: out[t] = sum_k w[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = ids[t, k].

Expert weights are stacked: `w13 [E, 2I, H]` (gate rows 0..I-1, up rows I..2I-1) and `w2 [E, H, I]`.

The Triton path (`fused_moe`):
1. `moe_align` sorts the T * K routed rows by expert, each expert's run padded to BLOCK_M (on the device);
2. `_gate_up_kernel`, a grouped GEMM: each program takes BLOCK_M rows of one expert, gathers their tokens' hidden
   states, multiplies by that expert's gate and up tiles (two accumulators sharing each A tile) and writes
   act(gate) * up: the activation is the epilogue, so the [T*K, 2I] gate/up product never reaches memory;
3. `_down_kernel`, a grouped GEMM by the same blocks: the down projection, times the routing weight of each row in
   the epilogue (float32), written per (token, k) row;
4. the top-k reduce: a sum over the K rows of each token (float32 accumulation).
Blocks past the padded row count exit at once (the count is read on the device), so sizes and grids depend only on
T: no host sync, and a CUDA graph captured for T tokens replays for any routing.

`fused_moe_ref` loops over experts in torch, in float32: the oracle for tests and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.ops.fused_moe_config import GemmTile, MoEKernelConfig, get_config
from pdserve.ops.moe_align import AlignedRows, moe_align
from pdserve.ops.split_k import NORM_MAX_PARTS, PartialSums

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_tanh": 1, "gelu_pytorch_tanh": 1}


def _act_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    code = ACTIVATIONS.get(activation)
    if code == 0:
        return F.silu(g)
    if code == 1:
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"unsupported MoE activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Loop over the experts that received rows; float32 math, result in x's dtype."""
    T, H = x.shape
    inter = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok].float()
        gate_up = xe @ w13[e].float().t()
        h = _act_ref(gate_up[:, :inter], activation) * gate_up[:, inter:]
        y = h @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


# The token pairs and row blocks change with every step's token count; as specialized integers (1, a multiple of
# 16, neither) each class would be compiled again, per tile config, inside the requests served.
VARYING_GEMM = ["num_pairs", "NUM_PID_M"]

if triton is not None:

    @triton.jit
    def _grouped_pid(NUM_PID_M, num_pid_n, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        group_m = min(NUM_PID_M - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        return pid_m, pid_n

    @triton.jit(do_not_specialize=VARYING_GEMM)
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, num_rows_ptr,
                        num_pairs, top_k, H, INTER, NUM_PID_M,
                        stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        ACT: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
        pid_m, pid_n = _grouped_pid(NUM_PID_M, tl.cdiv(INTER, BLOCK_N), GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ptr + offs_m)
        row_ok = rows < num_pairs
        tok = (rows // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < INTER
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
        g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        u_ptrs = g_ptrs + INTER * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:  # no K mask: the loads pipeline unpredicated
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < H - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_xk
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        if ACT == 0:  # silu
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            h = acc_g * tl.sigmoid(2.0 * z) * acc_u
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=VARYING_GEMM)
    def _down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, expert_ptr, num_rows_ptr,
                     num_pairs, INTER, H, NUM_PID_M,
                     stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
        pid_m, pid_n = _grouped_pid(NUM_PID_M, tl.cdiv(H, BLOCK_N), GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ptr + offs_m)
        row_ok = rows < num_pairs
        rows64 = rows.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < INTER - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        route_w = tl.load(weights_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * route_w[:, None]
        o_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    E, two_i, H = w13.shape
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x must be [T, {H}], got {tuple(x.shape)}")
    if two_i % 2 or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[{x.shape[0]}, K]")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")


def gate_up(x: torch.Tensor, w13: torch.Tensor, aligned: AlignedRows, top_k: int, activation: str,
            tile: GemmTile) -> torch.Tensor:
    """act(x[t] @ gate_e^T) * (x[t] @ up_e^T) for every routed row (t, k), in flat row order: [T * K, I]."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    n_pairs = T * top_k
    act = torch.empty((n_pairs, inter), dtype=x.dtype, device=x.device)
    grid = (aligned.max_blocks * triton.cdiv(inter, tile.BLOCK_N),)
    _gate_up_kernel[grid](
        x, w13, act, aligned.sorted_ids, aligned.expert_ids, aligned.num_rows,
        n_pairs, top_k, H, inter, aligned.max_blocks,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), act.stride(1),
        BLOCK_M=aligned.block_m, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
        ACT=ACTIVATIONS[activation], PRECISION=_precision(x.dtype), EVEN_K=H % tile.BLOCK_K == 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return act


def down(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, aligned: AlignedRows,
         tile: GemmTile) -> torch.Tensor:
    """w[t, k] * (act[row] @ down_e^T) for every routed row, in flat row order: [T * K, H]."""
    n_pairs, inter = act.shape
    H = w2.shape[1]
    out = torch.empty((n_pairs, H), dtype=act.dtype, device=act.device)
    weights = topk_weights.reshape(-1)
    grid = (aligned.max_blocks * triton.cdiv(H, tile.BLOCK_N),)
    _down_kernel[grid](
        act, w2, out, weights, aligned.sorted_ids, aligned.expert_ids, aligned.num_rows,
        n_pairs, inter, H, aligned.max_blocks,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=aligned.block_m, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
        PRECISION=_precision(act.dtype), EVEN_K=inter % tile.BLOCK_K == 0, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # 16-bit inputs ignore it


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu",
              config: MoEKernelConfig | None = None, parts: bool = False) -> torch.Tensor | PartialSums:
    """The Triton path: x [T, H], topk_weights/topk_ids [T, K] -> [T, H] in x's dtype. `parts`: with 2 to
    NORM_MAX_PARTS experts a token, the weighted rows of each token's experts as PartialSums ([K, T, H], a view of
    the down kernel's output), which the add+RMSNorm after the layer sums (pdserve.ops.norm): no reduce kernel."""
    if triton is None:
        raise RuntimeError("fused_moe needs Triton; use fused_moe_ref")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported MoE activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    _check(x, w13, w2, topk_weights, topk_ids)
    T, H = x.shape
    E, two_i, _ = w13.shape
    K = topk_ids.shape[1]
    if T == 0:
        return x.new_zeros((0, H))
    cfg = config or get_config(E, two_i // 2, H, x.dtype, T, K, x.device)
    aligned = moe_align(topk_ids, E, cfg.BLOCK_M)
    per_row = down(gate_up(x, w13, aligned, K, activation, cfg.gate_up), w2, topk_weights, aligned, cfg.down)
    if K == 1:
        return per_row
    if parts and K <= NORM_MAX_PARTS:
        return PartialSums(per_row.view(T, K, H).transpose(0, 1), x.dtype)
    return per_row.view(T, K, H).sum(dim=1)  # float32 accumulation inside the reduction

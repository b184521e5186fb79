"""Gated activations over a merged gate_up projection `[T, 2 * I]` (gate first, then up): act(gate) * up in one
Triton kernel (float32 math, one rounding), and the torch reference (the CPU path).

silu: Llama, Qwen3. gelu_tanh: Gemma 3 (gelu_pytorch_tanh). gelu (erf): kept for configs that ask for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.ops.dispatch import HAS_TRITON, use_fused
from pdserve.ops.pdl import pdl_args

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu"}  # Hugging Face hidden_act -> the kernel's name

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.ops.pdl import pdl_enter

    @triton.jit
    def act_mul(g, u, ACT: tl.constexpr):
        """act(g) * u in float32 (g, u float32): the gated activation's math, shared with the down projection's
        kernel that folds it in (pdserve.ops.linear.skinny_act_linear)."""
        if ACT == "silu":
            a = g * tl.sigmoid(g)
        elif ACT == "gelu_tanh":
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = g * tl.sigmoid(2.0 * z)  # 0.5 * g * (1 + tanh(z)) == g * sigmoid(2z)
        else:
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        return a * u

    @triton.jit
    def _act_and_mul_kernel(X, Out, s_x, s_o, n, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)  # pdserve.ops.pdl
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(X + t * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + t * s_x + n + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + t * s_o + cols, act_mul(g, u, ACT).to(Out.dtype.element_ty), mask=mask)


def _act(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu":
        return F.gelu(x)
    raise ValueError(f"unsupported activation {act!r}")


def act_and_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    """Today's math in the model dtype: act(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return _act(gate, act) * up


def act_and_mul_triton(x: torch.Tensor, act: str) -> torch.Tensor:
    if act not in ("silu", "gelu_tanh", "gelu"):
        raise ValueError(f"unsupported activation {act!r}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = shape[-1] // 2
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, ACT=act, BLOCK=block, num_warps=4 if block >= 512 else 2,
            **pdl_args(x2))
    return out.view(*shape[:-1], n)


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    if use_fused(x):
        return act_and_mul_triton(x, act)
    return act_and_mul_ref(x, act)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return act_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return act_and_mul(x, "gelu_tanh")

"""RMS norm, alone or fused with the residual add before it, as one Triton kernel per call (one program per row,
float32 accumulation), and the torch reference each kernel is tested against (the CPU path).

`offset=1` is Gemma's (1 + weight) form. The fused form is the pre-norm decoder's
`residual = x + residual; x = norm(residual)`; it returns both. `rows` normalizes only the given rows (the final
norm of the rows the sampler needs, gathered in the same pass). `x` may also be a product left as float32 partial
sums over K (pdserve.ops.split_k.PartialSums), or a MoE layer's rows of its top-k experts (pdserve.ops.fused_moe,
parts=True): the kernel adds the parts in float32, rounds their sum to the model's dtype as the product (or torch's
sum over the experts) would have been, then adds the residual.
"""

from __future__ import annotations

import torch

from pdserve.ops.dispatch import HAS_TRITON, num_warps_for, use_fused
from pdserve.ops.pdl import pdl_args
from pdserve.ops.split_k import NORM_MAX_PARTS, PartialSums, materialize

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.ops.pdl import pdl_enter

    @triton.jit
    def _rms_norm_kernel(X, R, W, ROWS, Out, ROut, s_x, s_part, s_r, s_o, s_ro, n_cols, eps, offset,
                         HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, STORE_RES: tl.constexpr,
                         PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)  # pdserve.ops.pdl
        i = tl.program_id(0).to(tl.int64)
        row = i
        if HAS_ROWS:
            row = tl.load(ROWS + i).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * s_x + cols, mask=mask, other=0.0)
        if PARTS > 1:  # partial products over K (pdserve.ops.split_k) or experts' rows: their sum, rounded once
            xf = x.to(tl.float32)
            for p in tl.static_range(1, PARTS):
                xf += tl.load(X + p * s_part + row * s_x + cols, mask=mask, other=0.0)
            x = xf.to(Out.dtype.element_ty)
        if HAS_RES:
            r = tl.load(R + row * s_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(Out.dtype.element_ty)  # rounded as the model's dtype adds
            if STORE_RES:
                tl.store(ROut + i * s_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + i * s_o + cols, (xf * rstd * (w + offset)).to(Out.dtype.element_ty), mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Hugging Face's math: float32 statistics; Llama/Qwen scale in the model dtype, Gemma in float32."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_ref(residual, weight, eps, offset), residual


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x, residual, weight, eps, offset, rows, store_res):
    shape, dtype = x.shape, x.dtype
    if isinstance(x, PartialSums):
        x2 = x.parts if x.parts.stride(-1) == 1 else x.parts.contiguous()
        num_parts, s_part = x2.shape[0], x2.stride(0)
        if x2.dim() != 3 or num_parts > NORM_MAX_PARTS:
            raise ValueError(f"partial sums of shape {tuple(x2.shape)}: [parts <= {NORM_MAX_PARTS}, rows, cols]")
        _, n_rows, n = x2.shape
    else:
        x2 = _rows2d(x)
        num_parts, s_part = 1, 0
        n_rows, n = x2.shape
    r2 = _rows2d(residual) if residual is not None else x2
    if rows is not None:
        rows = rows.reshape(-1)
        n_rows = rows.shape[0]
    out = torch.empty((n_rows, n), dtype=dtype, device=x.device)
    r_out = torch.empty((n_rows, n), dtype=dtype, device=x.device) if store_res else out
    if n_rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, rows if rows is not None else x2, out, r_out,
            x2.stride(-2), s_part, r2.stride(0), out.stride(0), r_out.stride(0), n, eps, float(offset),
            HAS_RES=residual is not None, HAS_ROWS=rows is not None, STORE_RES=store_res, PARTS=num_parts,
            BLOCK=block, num_warps=num_warps_for(block), **pdl_args(x2),
        )
    if rows is None:
        out = out.view(shape)
        r_out = r_out.view(shape)
    return out, r_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(x, None, weight, eps, offset, rows, False)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps, offset, None, True)


def add_rms_norm_rows_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                             offset: float, rows: torch.Tensor) -> torch.Tensor:
    """norm((x + residual)[rows]) in one pass: the final norm of the rows that reach the LM head."""
    return _launch(x, residual, weight, eps, offset, rows, False)[0]


def _fused_for(x: torch.Tensor | PartialSums) -> bool:
    return use_fused(x.parts if isinstance(x, PartialSums) else x)


def rms_norm(x: torch.Tensor | PartialSums, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    if _fused_for(x):
        return rms_norm_triton(x, weight, eps, offset)
    return rms_norm_ref(materialize(x), weight, eps, offset)


def fused_add_rms_norm(x: torch.Tensor | PartialSums, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); new tensors, the inputs are left as they were. `x` may be a product's
    float32 partial sums over K (pdserve.ops.split_k), summed here and rounded once before the add."""
    if _fused_for(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, offset)
    return fused_add_rms_norm_ref(materialize(x), residual, weight, eps, offset)


def final_rms_norm(x: torch.Tensor | PartialSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   offset: float = 0.0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x + residual) of `rows` (every row when None): the model's last norm, before the LM head."""
    if _fused_for(x):
        if rows is None:
            return (fused_add_rms_norm_triton(x, residual, weight, eps, offset)[0] if residual is not None
                    else rms_norm_triton(x, weight, eps, offset))
        return add_rms_norm_rows_triton(x, residual, weight, eps, offset, rows)
    x = materialize(x)
    if rows is not None:
        x = x.index_select(0, rows)
        residual = residual.index_select(0, rows) if residual is not None else None
    return rms_norm_ref(x if residual is None else x + residual, weight, eps, offset)

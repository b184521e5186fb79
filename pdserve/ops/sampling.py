"""One token per row of a batch's logits in one pass: greedy rows take the argmax, the others a draw from
softmax(logits / temperature) by the Gumbel-max trick (argmax of logits / T + G, G = -log(-log(U)) with U from
Triton's Philox stream), which is the same distribution as the exponential race of pdserve.engine.sampler.

Why: a request without `temperature` samples at 1.0 (the OpenAI default, and what vLLM's `bench serve` now sends:
nothing), and the torch path for it widens the logits to float32, divides, takes a softmax, draws a [rows, vocab]
exponential tensor and divides again before its argmax: several passes over [rows, vocab] float32 and a dozen
kernels a step (at 256 rows of Qwen3's 151,936 tokens, 155 MB a pass). This kernel reads the 16-bit logits once.

Which rows: no logprobs, nothing that changes the logits (penalties, bias, allowed ids, min_tokens), no top-k, top-p
or min-p, no per-request seed (those keep the torch path and its generators). Greedy rows give exactly
`logits.argmax(-1)` (the first index of the largest value). `sample_ref` is the torch oracle of the same contract,
used on CPU and in the tests; the draws differ from the kernel's (different random streams), their distribution not.
"""

from __future__ import annotations

import torch

from pdserve.ops.dispatch import HAS_TRITON, use_fused

BLOCK = 2048  # vocabulary entries a program reads per step of its loop

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seed"])
    def _gumbel_argmax_kernel(L, INV_T, Out, seed, V, s_l, BLOCK: tl.constexpr):
        """Program r: the token of row r. INV_T[r] = 1 / temperature, or 0 for a greedy row (no noise)."""
        r = tl.program_id(0).to(tl.int64)
        inv_t = tl.load(INV_T + r)
        noisy = inv_t > 0.0
        best_v = -float("inf")
        best_i = 0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < V
            x = tl.load(L + r * s_l + cols, mask=m, other=-float("inf")).to(tl.float32)
            u = tl.rand(seed, (r * V + cols).to(tl.int32))  # one uniform per (row, token): distinct offsets
            g = -tl.log(-tl.log(u))
            x = x * tl.where(noisy, inv_t, 1.0) + tl.where(noisy, g, 0.0)
            x = tl.where(m, x, -float("inf"))
            v = tl.max(x, 0)
            i = tl.argmax(x, 0, tie_break_left=True)
            take = v > best_v
            best_i = tl.where(take, start + i, best_i)
            best_v = tl.where(take, v, best_v)
        tl.store(Out + r, best_i.to(tl.int64))


def sample_ref(logits: torch.Tensor, inv_temp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The torch form: argmax for rows with inv_temp 0, else argmax(logits * inv_temp + Gumbel noise)."""
    x = logits.float()
    u = torch.rand(x.shape, generator=generator, device=x.device).clamp_(min=torch.finfo(torch.float32).tiny)
    noisy = inv_temp.to(x.device).float().unsqueeze(1)
    y = torch.where(noisy > 0, x * noisy - torch.log(-torch.log(u)), x)
    return y.argmax(-1)


def sample_tokens(logits: torch.Tensor, inv_temp: torch.Tensor, seed: int) -> torch.Tensor:
    """[rows] int64 token ids of `logits` [rows, vocab] (any float dtype, vocab contiguous); `inv_temp` [rows]
    float32 on the logits' device (0: greedy); `seed` picks the Philox stream (a fresh one each step)."""
    rows, vocab = logits.shape
    if rows * vocab >= 2**31:
        raise ValueError(f"sample_tokens: {rows} rows x {vocab} tokens exceed the random stream's int32 offsets")
    if not use_fused(logits):
        g = torch.Generator(device=logits.device).manual_seed(seed)
        return sample_ref(logits, inv_temp, g)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, inv_temp, out, seed, vocab, logits.stride(0), BLOCK=BLOCK,
                                       num_warps=8)
    return out

"""One token per row of a batch's logits in one pass: greedy rows take the argmax, the others a draw from
softmax(logits / temperature) by the Gumbel-max trick (argmax of logits / T + G, G = -log(-log(U)) with U from
Triton's Philox stream), which is the same distribution as the exponential race of pdserve.engine.sampler.

Why: a request without `temperature` samples at 1.0 (the OpenAI default, and what vLLM's `bench serve` now sends:
nothing), and the torch path for it widens the logits to float32, divides, takes a softmax, draws a [rows, vocab]
exponential tensor and divides again before its argmax: several passes over [rows, vocab] float32 and a dozen
kernels a step (at 256 rows of Qwen3's 151,936 tokens, 155 MB a pass). This kernel reads the 16-bit logits once.

Which rows: no logprobs, nothing that changes the logits (penalties, bias, allowed ids, min_tokens), no top-k, top-p
or min-p, no per-request seed (those keep the torch path and its generators). Greedy rows give exactly
`logits.argmax(-1)` (the first index of the largest value). A row is split over several programs when the batch has
few rows (one row alone over ~4 x the SMs: its loop would otherwise be one program's), and a second kernel picks
each row's best of their partial bests. `sample_ref` is the torch oracle of the same contract,
used on CPU and in the tests; the draws differ from the kernel's (different random streams), their distribution not.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pdserve.ops.dispatch import HAS_TRITON, use_fused

QUARTER = 512  # columns per draw of the Philox stream's four outputs: 2048 columns a step of a program's loop
TARGET_PROGRAMS_PER_SM = 4  # a row is split over programs until the grid has about this many per SM
MAX_SPLITS = 128  # programs a row at most: the pick kernel's one tile (one compiled variant for every split)
# warps a program: 8 against 4 took the kernels from 173.3 to 142.1 us at 256 rows, 43.5 to 38.5 at 64 and 5.8 to
# 4.4 at one row on an H200 (bench_sampler.py --sweep, benchmarks/lease_s22/s22e; more programs per SM moved little)
NUM_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seed", "CHUNK", "S"])  # one binary whatever the split (no compile at serving)
    def _gumbel_argmax_kernel(L, INV_T, PV, PI, seed, V, s_l, CHUNK, S, Q: tl.constexpr):
        """Program (r, c): the best column of row r within columns [c * CHUNK, (c + 1) * CHUNK), into PV/PI[r * S + c]
        (its score and index). INV_T[r] = 1 / temperature, or 0 for a greedy row (no noise). Scores are in log2 units
        (x / T * log2(e) - log2(-log2(U)): the Gumbel-max score over ln 2, less a constant), so every logarithm is one
        lg2; each Philox draw gives four uniforms, one for each quarter of a 4 * Q step."""
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        inv_t = tl.load(INV_T + r)
        noisy = inv_t > 0.0
        scale = tl.where(noisy, inv_t * 1.4426950408889634, 1.0)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        # per lane: the best score so far and its column (strictly greater only, so each lane keeps the first of
        # equal scores: its columns only grow); one reduction across lanes at the end, not two a quarter
        best_v = tl.full([Q], -float("inf"), tl.float32)
        best_i = tl.zeros([Q], tl.int32)
        q = tl.arange(0, Q)
        for start in range(lo, hi, 4 * Q):
            # row r's draws: offsets [r * span, (r + 1) * span), span = Q per 4 * Q-column step of the row
            u0, u1, u2, u3 = tl.rand4x(seed, (r * (tl.cdiv(V, 4 * Q) * Q) + start // 4 + q).to(tl.int32))
            for j in tl.static_range(4):
                u = u0 if j == 0 else u1 if j == 1 else u2 if j == 2 else u3
                cols = start + j * Q + q
                m = cols < hi
                x = tl.load(L + r * s_l + cols, mask=m, other=-float("inf")).to(tl.float32)
                g = -tl.log2(-tl.log2(u))
                x = x * scale + tl.where(noisy, g, 0.0)
                take = m & (x > best_v)
                best_i = tl.where(take, cols, best_i)
                best_v = tl.where(take, x, best_v)
        v = tl.max(best_v, 0)
        i = tl.min(tl.where(best_v == v, best_i, V), 0)  # the first column of the best score across lanes
        tl.store(PV + r * S + c, v)
        tl.store(PI + r * S + c, i.to(tl.int64))

    @triton.jit(do_not_specialize=["S"])
    def _pick_kernel(PV, PI, Out, S, BLOCK_S: tl.constexpr):
        """Program r: the first of row r's S partial bests with the highest score."""
        r = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_S)
        v = tl.load(PV + r * S + k, mask=k < S, other=-float("inf"))
        best = tl.argmax(v, 0, tie_break_left=True)
        tl.store(Out + r, tl.load(PI + r * S + best))


@lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(rows: int, vocab: int, sms: int, programs_per_sm: int | None = None) -> tuple[int, int]:
    """(programs a row, columns a program): enough programs for ~TARGET_PROGRAMS_PER_SM per SM, whole 4 * QUARTER
    steps each."""
    step = 4 * QUARTER
    steps = -(-vocab // step)
    per_sm = programs_per_sm or TARGET_PROGRAMS_PER_SM
    s = max(1, min(steps, MAX_SPLITS, -(-per_sm * sms // max(1, rows))))
    chunk = -(-steps // s) * step
    return -(-vocab // chunk), chunk


def sample_ref(logits: torch.Tensor, inv_temp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The torch form: argmax for rows with inv_temp 0, else argmax(logits * inv_temp + Gumbel noise)."""
    x = logits.float()
    u = torch.rand(x.shape, generator=generator, device=x.device).clamp_(min=torch.finfo(torch.float32).tiny)
    noisy = inv_temp.to(x.device).float().unsqueeze(1)
    y = torch.where(noisy > 0, x * noisy - torch.log(-torch.log(u)), x)
    return y.argmax(-1)


def sample_tokens(logits: torch.Tensor, inv_temp: torch.Tensor, seed: int, *, programs_per_sm: int | None = None,
                  num_warps: int = NUM_WARPS) -> torch.Tensor:
    """[rows] int64 token ids of `logits` [rows, vocab] (any float dtype, vocab contiguous); `inv_temp` [rows]
    float32 on the logits' device (0: greedy); `seed` picks the Philox stream (a fresh one each step).
    `programs_per_sm` and `num_warps` override the launch shape (benchmarks/engine/bench_sampler.py --sweep)."""
    rows, vocab = logits.shape
    per_row = -(-vocab // (4 * QUARTER)) * QUARTER  # the random stream's offsets a row takes (int32 in the kernel)
    if rows * per_row >= 2**31:  # ~14k rows of a 152k vocabulary: in parts, each its own stream
        part = (2**31 - 1) // per_row
        return torch.cat([sample_tokens(logits[i: i + part], inv_temp[i: i + part], (seed + 1 + i // part) % 2**31,
                                        programs_per_sm=programs_per_sm, num_warps=num_warps)
                          for i in range(0, rows, part)])
    if not use_fused(logits):
        g = torch.Generator(device=logits.device).manual_seed(seed)
        return sample_ref(logits, inv_temp, g)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    s, chunk = split_plan(rows, vocab, _sm_count(logits.device), programs_per_sm)
    pv = torch.empty(rows * s, dtype=torch.float32, device=logits.device)
    pi = out if s == 1 else torch.empty(rows * s, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, s)](logits, inv_temp, pv, pi, seed, vocab, logits.stride(0), chunk, s, Q=QUARTER,
                                     num_warps=num_warps)
    if s > 1:
        _pick_kernel[(rows,)](pv, pi, out, s, BLOCK_S=MAX_SPLITS, num_warps=1)
    return out

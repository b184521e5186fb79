"""One token per row of a batch's logits: greedy rows take the argmax, the others a draw from
softmax(logits / temperature) by inverse-CDF sampling (one uniform a row from Triton's Philox stream), which is the
same distribution as the exponential race of pdserve.engine.sampler.

Why: a request without `temperature` samples at 1.0 (the OpenAI default, and what vLLM's `bench serve` now sends:
nothing), and the torch path for it widens the logits to float32, divides, takes a softmax, draws a [rows, vocab]
exponential tensor and divides again before its argmax: several passes over [rows, vocab] float32 and a dozen
kernels a step (at 256 rows of Qwen3's 151,936 tokens, 155 MB a pass). A first kernel drew by the Gumbel-max trick
(a Philox uniform and two logarithms for every logit): 142 us at 256 rows on an H200, bound by the 39M random numbers,
where reading the 16-bit logits once takes ~20 us. Inverse-CDF sampling needs one uniform a row instead:

- `_partials_kernel`, grid (rows, S): program (r, c) reads columns [c * CHUNK, (c + 1) * CHUNK) of row r once, with
  per-lane state only (one reduction across lanes at the end): x = logit / T * log2(e), the lane's running max m and
  sum s of 2^(x - m) (one exp2 a logit: 2^-|x - m| is both the new term and the rescale when m grows), and the column
  of its first largest value. Its chunk's max M_c, sum S_c (in units of 2^M_c) and first argmax go to PM/PS/PI.
- `_pick_kernel`, grid (rows,): a greedy row takes the argmax of the first chunk holding the row's largest value
  (exactly `logits.argmax(-1)`: the first index of the largest value). A sampled row weighs its chunks
  w_c = S_c * 2^(M_c - M), draws u = tl.rand(seed, r) (row r's Philox counter r: a fresh seed each step is a fresh
  stream), takes the first chunk whose running sum of w passes u * W, and reads that one chunk again in tiles of 2048
  columns (a tile's sum a step, the next tile's load in flight, until the running sum passes the target; that tile's
  tl.cumsum) up to the first column whose running sum of 2^(x - M_c) passes the rest of the target. Where rounding
  leaves the target past the re-summed chunk, the chunk's last column of non-zero probability. A column of
  probability 0 (a -inf logit) is never taken.

The logits are read once in the first kernel and one chunk a sampled row in the second (chunks of at most
MAX_CHUNK_STEPS * 2048 columns). On an H200 at 256 rows x 151,936 bf16 (the kernels alone in a CUDA graph): 37.9 us
sampled (the first kernel ~29, the second ~9) and 25.0 greedy, against 142.0 for the Gumbel kernel; 125 / 85 against
545 at 1024 rows; 6.1 against 4.0 at one row (two launches). Sums are float32: probabilities below ~1e-7 of a row's
mass are drawn with that relative error (as the Gumbel kernel's float32 scores); +inf or NaN logits in a sampled row
give a valid column, no particular distribution.

Which rows: no logprobs, nothing that changes the logits (penalties, bias, allowed ids, min_tokens), no top-k, top-p
or min-p, no per-request seed (those keep the torch path and its generators). A row is split over more programs when
the batch has few rows (one row alone over ~4 x the SMs: its loop would otherwise be one program's). `sample_ref` is
the torch oracle of the same contract (the Gumbel-max trick over torch's generator), used on CPU and in the tests; the
draws differ from the kernel's (different methods and random streams), their distribution not.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pdserve.ops.dispatch import HAS_TRITON, use_fused

BLOCK = 2048  # columns a step of the first kernel's loop (one a lane); chunks are whole steps
TARGET_PROGRAMS_PER_SM = 4  # a row is split over programs until the grid has about this many per SM
# steps a chunk at most (16,384 columns): the second kernel reads one chunk a sampled row again, so a row is split
# into at least vocab / (this * BLOCK) chunks whatever the row count (10 at Qwen3's vocabulary)
MAX_CHUNK_STEPS = 8  # 4 / 8 / 16: 40.5 / 37.9 / 42.3 us at 256 rows on an H200 (bench_sampler.py --sweep)
MAX_SPLITS = 128  # chunks a row at most: the second kernel's one tile of partials (one variant for every split)
TILE = 2048  # columns a step of the second kernel's scan of the chosen chunk
# warps a program of the first kernel (8 against 4: 37.9 against 43.2 us at 256 rows on an H200, bench_sampler.py
# --sweep), and of the second (4: 9.2 us at 256 rows, 2048-column tiles; 8 warps 9.4, 1024-column tiles 12.0)
NUM_WARPS = 8
PICK_WARPS = 4
# steps of the first kernel's loop an iteration, their loads in flight together: 1 / 2 / 4 took it 33.7 / 29.0 / 33.6
# us at 256 rows sampled, 29.0 / 23.0 / 24.0 greedy
UNROLL = 2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["STEPS", "S"])  # one binary whatever the split (no compile at serving)
    def _partials_kernel(L, INV_T, PM, PS, PI, V, s_l, STEPS, S, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        """Program (r, c): columns [c * CHUNK, (c + 1) * CHUNK) of row r, CHUNK = STEPS * BLOCK (passed in steps, so
        that the compiler knows every step starts on a multiple of BLOCK: 16-byte loads), UNROLL steps an iteration
        (their loads in flight together). INV_T[r] = 1 / temperature, or 0 for a greedy row. Into PM/PS/PI[r * S + c]:
        the chunk's largest x (x = logit * INV_T[r] * log2(e) for a sampled row, the logit for a greedy one), the sum
        of 2^(x - PM) over the chunk (sampled rows) and the chunk's first column of the largest x."""
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        inv_t = tl.load(INV_T + r)
        lo = c * STEPS * BLOCK
        hi = tl.minimum(lo + STEPS * BLOCK, V)
        lane = tl.arange(0, BLOCK)
        row = L + r * s_l
        i = lo + lane  # per lane: the column of its largest x so far (strictly greater only: the first of equals)
        if inv_t > 0.0:
            scale = inv_t * 1.4426950408889634
            # per lane: the running max m (from -FLT_MAX, so that a -inf logit gives 2^(-inf - m) = 0, never the NaN
            # of -inf - -inf) and s = sum of 2^(x - m); one exp2 a logit: 2^-|x - m| is the new term when x <= m,
            # and the factor rescaling s when x is the new max (then s * 2^(m - x) + 1)
            m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
            s = tl.zeros([BLOCK], tl.float32)
            for start in range(lo, hi, UNROLL * BLOCK):
                for u in tl.static_range(UNROLL):
                    cols = start + u * BLOCK + lane
                    x = tl.load(row + cols, mask=cols < hi, other=-float("inf")).to(tl.float32) * scale
                    up = x > m
                    e = tl.exp2(-tl.abs(x - m))
                    s = tl.where(up, s * e + 1.0, s + e)
                    i = tl.where(up, cols, i)
                    m = tl.where(up, x, m)
            mc = tl.max(m, 0)
            tl.store(PS + r * S + c, tl.sum(s * tl.exp2(m - mc), 0))
        else:
            m = tl.full([BLOCK], -float("inf"), tl.float32)
            for start in range(lo, hi, UNROLL * BLOCK):
                for u in tl.static_range(UNROLL):
                    cols = start + u * BLOCK + lane
                    x = tl.load(row + cols, mask=cols < hi, other=-float("inf")).to(tl.float32)
                    up = x > m
                    i = tl.where(up, cols, i)
                    m = tl.where(up, x, m)
            mc = tl.max(m, 0)
        tl.store(PM + r * S + c, mc)
        tl.store(PI + r * S + c, tl.min(tl.where(m == mc, i, V), 0))  # the first column of the largest across lanes

    @triton.jit(do_not_specialize=["seed", "STEPS", "S"])
    def _pick_kernel(L, INV_T, PM, PS, PI, Out, seed, V, s_l, STEPS, S, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                     TILE: tl.constexpr):
        """Program r: row r's token from its S partials (chunks in column order). Greedy: the argmax of the first
        chunk with the row's largest value. Sampled: the inverse CDF at u = tl.rand(seed, r), over the chunks' weights,
        then over the chosen chunk's columns, read again TILE columns a step: a tile's sum (one reduction, the next
        tile's load already in flight) until the running sum passes the target, then that tile's cumsum."""
        r = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_S)
        part = r * S
        pm = tl.load(PM + part + k, mask=k < S, other=-float("inf"))
        best = tl.argmax(pm, 0, tie_break_left=True)  # the first chunk of the row's largest value
        inv_t = tl.load(INV_T + r)
        if inv_t > 0.0:
            ps = tl.load(PS + part + k, mask=k < S, other=0.0)
            top = tl.max(pm, 0)
            w = ps * tl.exp2(pm - top)  # chunk c's mass in units of 2^top
            cum = tl.cumsum(w, 0)
            target = tl.rand(seed, r.to(tl.int32)) * tl.max(cum, 0)  # u in [0, 1): row r's counter of the stream
            c = tl.min(tl.where(cum > target, k, BLOCK_S), 0)  # the first chunk whose running sum passes the target
            last_w = tl.max(tl.where(w > 0.0, k, -1), 0)
            c = tl.where(c < BLOCK_S, c, tl.where(last_w >= 0, last_w, best))  # rounding (or no finite mass)
            before = tl.sum(tl.where(k == c - 1, cum, 0.0), 0)
            mc = tl.sum(tl.where(k == c, pm, 0.0), 0)  # from registers: one dependent load fewer
            rest = (target - before) / tl.exp2(mc - top)  # what is left of the target, in units of 2^mc
            scale = inv_t * 1.4426950408889634
            lo = c * STEPS * BLOCK  # TILE divides BLOCK: every tile starts on a multiple of TILE
            hi = tl.minimum(lo + STEPS * BLOCK, V)
            t = tl.arange(0, TILE)
            row = L + r * s_l
            start = lo
            cols = lo + t
            x = tl.load(row + cols, mask=cols < hi, other=-float("inf"))
            nxt = tl.load(row + cols + TILE, mask=cols + TILE < hi, other=-float("inf"))  # the next tile in flight
            p = tl.exp2(x.to(tl.float32) * scale - mc)
            total = tl.full((), 0.0, tl.float32)
            tsum = tl.sum(p, 0)
            last = tl.full([TILE], -1, tl.int32)  # per lane: its last column of non-zero probability
            while (total + tsum <= rest) & (start + TILE < hi):  # the target lies past this tile, which is not the last
                last = tl.where(p > 0.0, cols, last)
                total += tsum
                start += TILE
                cols = tl.multiple_of(start, TILE) + t
                x = nxt
                nxt = tl.load(row + cols + TILE, mask=cols + TILE < hi, other=-float("inf"))
                p = tl.exp2(x.to(tl.float32) * scale - mc)
                tsum = tl.sum(p, 0)
            # this tile holds the target, or is the chunk's last: the first column whose running sum passes it; if
            # none (the target past the re-summed chunk by rounding), the last column of non-zero probability
            live = p > 0.0
            last = tl.max(tl.where(live, cols, last), 0)
            hit = tl.min(tl.where(live & (tl.cumsum(p, 0) + total > rest), cols, V), 0)
            tok = tl.where(hit < V, hit, tl.where(last >= 0, last, tl.load(PI + part + c)))
            tl.store(Out + r, tok.to(tl.int64))
        else:
            tl.store(Out + r, tl.load(PI + part + best).to(tl.int64))


@lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(rows: int, vocab: int, sms: int, programs_per_sm: int | None = None,
               max_chunk_steps: int | None = None) -> tuple[int, int]:
    """(chunks a row, columns a chunk): enough programs for ~TARGET_PROGRAMS_PER_SM per SM, and chunks of at most
    MAX_CHUNK_STEPS steps (the second kernel reads one again), whole BLOCK-column steps each."""
    step = BLOCK
    steps = -(-vocab // step)
    per_sm = programs_per_sm or TARGET_PROGRAMS_PER_SM
    cap = max_chunk_steps or MAX_CHUNK_STEPS
    s = max(1, min(steps, MAX_SPLITS, max(-(-per_sm * sms // max(1, rows)), -(-steps // cap))))
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
                  num_warps: int = NUM_WARPS, max_chunk_steps: int | None = None,
                  pick_warps: int = PICK_WARPS, unroll: int = UNROLL) -> torch.Tensor:
    """[rows] int64 token ids of `logits` [rows, vocab] (any float dtype, vocab contiguous); `inv_temp` [rows]
    float32 on the logits' device (0: greedy); `seed` picks the Philox stream (a fresh one each step; row r draws
    the stream's counter r, whatever the batch). `programs_per_sm`, `num_warps`, `max_chunk_steps` and `pick_warps`
    override the launch shape (benchmarks/engine/bench_sampler.py --sweep), `unroll` the first kernel's loop."""
    rows, vocab = logits.shape
    if not use_fused(logits):
        g = torch.Generator(device=logits.device).manual_seed(seed)
        return sample_ref(logits, inv_temp, g)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    s, chunk = split_plan(rows, vocab, _sm_count(logits.device), programs_per_sm, max_chunk_steps)
    pm = torch.empty(rows * s, dtype=torch.float32, device=logits.device)
    ps = torch.empty_like(pm)
    pi = torch.empty(rows * s, dtype=torch.int32, device=logits.device)
    _partials_kernel[(rows, s)](logits, inv_temp, pm, ps, pi, vocab, logits.stride(0), chunk // BLOCK, s, BLOCK=BLOCK,
                                UNROLL=unroll, num_warps=num_warps)
    _pick_kernel[(rows,)](logits, inv_temp, pm, ps, pi, out, seed, vocab, logits.stride(0), chunk // BLOCK, s,
                          BLOCK=BLOCK, BLOCK_S=MAX_SPLITS, TILE=TILE, num_warps=pick_warps)
    return out

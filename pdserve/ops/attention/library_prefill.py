"""Long prefill rows through cuDNN's fused attention (the kernel behind torch SDPA's cuDNN backend), chosen by
measurement; the Triton kernel (prefill.py) stays the path that always works, and the torch reference the oracle.

Why: on an H200 with dummy Qwen3-8B's heads (32 x 128 over 8 KV heads, bf16), the Triton prefill kernel runs at
400-450 TFLOP/s on long rows, about FlashAttention-2's speed, and cuDNN's at 575-615 (benchmarks/lease_s16,
probe_sdpa_backends.py): 894 vs 1281 us for a fresh 8192-token prompt, 6.7 vs 9.7 ms for an 8192-token chunk on a
24576-token prefix. vLLM runs FlashAttention 3 there, which is what made the 32k prompt's TTFT 1.12-1.19x vLLM's.

How, for one prefill row of q_len new tokens on ctx tokens already in the pool:
- ctx > 0: the prefix's K and V are gathered out of the pool (its blocks, in block-table order: 4 KiB a token for
  8 x 128 bf16 heads), on CUDA by one Triton kernel (a program per block and K or V: the pool's layer view is
  strided, and torch's index_select over it moved ~0.9 TB/s);
- one causal call (top-left aligned) over the new tokens, with any prefix tokens past the last multiple of
  PREFIX_BUCKET in front of them as dummy query rows (so the square is causal as a chunk needs), zero-padded at
  the end to a multiple of QUERY_BUCKET;
- where the prefix reaches PREFIX_BUCKET: one unmasked call of the new tokens (zero-padded likewise) against the
  prefix up to its last multiple of PREFIX_BUCKET, and `merge_two` (a Triton kernel) combines the two by their
  log-sum-exps, writing the output rows in place.
An input already of its call's shape with its heads packed (stride H x D between rows, as q/k/v are once copied)
goes in as it is, and a whole chunk's queries are copied once for both calls; only rows the input does not cover are
zeroed. Padding keeps the calls to a bounded set of shapes: cuDNN builds an execution plan the first time it sees a
shape, which took 49-105 ms on an H200 (709 ms for the process's first chunk), and without buckets every new prompt
length, and every chunk whose size the step's decode rows shifted, would pay that in its TTFT. torch's single call
with a lower-right causal mask ran 1.6-1.7x slower than the two calls (it materializes the mask). The calls are
torch.ops.aten._scaled_dot_product_cudnn_attention, the op torch's SDPA dispatches to; grouped query heads go to
cuDNN as they are (no repeat of K/V).

Which rows: a step uses the library only if every prefill row in it qualifies (decode rows still go to the Triton
decode kernel): a fresh prompt of at least MIN_FRESH tokens, or a chunk of at least MIN_CHUNK tokens on a prefix, or of
at least MIN_PLANNED whose call shapes have plans already (the warm-up's: --max-long-prefill-tokens' chunks);
bf16/fp16, a pool of the model's dtype (or an fp8 one, where FP8_POOLS: the prefix is dequantized as it is gathered),
head dim <= 128, no sliding window or softcapping, the step's K/V given, a CUDA device of compute capability 9.0 or
later with cuDNN. `PDSERVE_PREFILL_LIBRARY=none` turns it off.

Memory: the gathered prefix, the padded inputs, the partial outputs and their log-sum-exps live for one layer's
attention. The KV sizing probe measures them with a prompt of the model's length whose last chunk is a whole step
on the longest prefix (pdserve.engine.memory_profile); `transient_bytes` bounds them where that probe cannot run.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache

import torch

from pdserve import envs
from pdserve.ops.attention.common import is_fp8
from pdserve.ops.attention.metadata import AttentionMetadata
from pdserve.ops.attention.plan_watch import WATCH as PLANS
from pdserve.ops.dispatch import HAS_TRITON, use_fused

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_blocks_kernel(KV, TABLE, Out, KS, VS, s_b, s_kv, s_t, s_h, s_okv, HK: tl.constexpr,
                              D: tl.constexpr, BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                              DEQUANT: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr):
        """Program (i, w): the row's i-th block of K (w = 0) or V (w = 1), [BS, HK, D] out of the strided layer view,
        into rows i * BS ... of Out[w] ([rows, HK, D], contiguous). DEQUANT (an fp8 pool): each value times its
        scale (KS for K, VS for V, where given) in fp32, rounded to Out's dtype, as torch_ref.dequantize does."""
        i = tl.program_id(0)
        w = tl.program_id(1)
        blk = tl.load(TABLE + i).to(tl.int64)
        t = tl.arange(0, BS)[:, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None]
        d = tl.arange(0, BLOCK_D)[None, None, :]
        mask = (h < HK) & (d < D) & (t < BS)
        x = tl.load(KV + blk * s_b + w * s_kv + t * s_t + h * s_h + d, mask=mask)
        if DEQUANT:
            y = x.to(tl.float32)
            ks = tl.load(KS).to(tl.float32) if HAS_KS else 1.0
            vs = tl.load(VS).to(tl.float32) if HAS_VS else 1.0
            if HAS_KS or HAS_VS:
                y = y * tl.where(w == 0, ks, vs)
            x = y.to(Out.dtype.element_ty, fp_downcast_rounding="rtne")
        dst = Out + w.to(tl.int64) * s_okv + (i.to(tl.int64) * BS + t) * (HK * D) + h * D + d
        tl.store(dst, x, mask=mask)

log = logging.getLogger(__name__)

MIN_FRESH = 2048  # a whole prompt: cuDNN 87 vs Triton 116 us at 2048 tokens, 14.7 vs 19.5 ms at 32768 (H200)
MIN_CHUNK = 4096  # a chunk on a prefix of a shape not planned yet (H200, dummy Qwen3-8B): 1.08-1.28x faster at 4096 on
# 4k-8k prefixes, 1.32-1.44x at 8192 on 8k-24k; from here a step's gain pays for the plan a new shape costs (below);
# PDSERVE_PREFILL_LIBRARY_MIN_CHUNK changes it for an A/B
MIN_PLANNED = 512  # a chunk on a prefix whose shapes already have plans (the warm-up's, or met before) goes to cuDNN
# from this length: whole engine steps with cuDNN against the Triton kernel (benchmarks/lease_s28) were 1.12-1.25x
# faster at 1024 tokens on 8k-31k prefixes (1.01x on 1024), 1.14-1.27x at 2048 (1.03x on 2048), 1.00-1.17x at 512
MIN_CHUNK = envs.prefill_library_min_chunk(MIN_CHUNK)
MAX_HEAD_DIM = 128  # measured at 128
QUERY_BUCKET = 256  # calls' query (and causal key) counts are rounded up to this: a bounded set of shapes
PREFIX_BUCKET = 1024  # the unmasked call's prefix length is rounded down to this; the rest joins the causal call
WARM_MAX_PREFIXES = 64  # start-up builds chunk shapes for prefixes up to this many PREFIX_BUCKETs (warm_shapes)
DTYPES = (torch.bfloat16, torch.float16)
# FP8_POOLS: rows over an fp8 pool go to cuDNN too, the prefix dequantized into the model's dtype as it is gathered
# (the step's own K/V are unquantized, as the Triton kernel reads them). Why: over an fp8 pool the Triton prefill
# kernel ran at ~274 TFLOP/s (dummy Qwen3-30B-A3B on an H200, benchmarks/lease_s38/p32). Measured (lease_s39): that
# model's 8192-token chunk on a 24576-token prefix 767/767 -> 397/396 ms a step (arms off, on, off, on), a fresh
# 8192-token prompt 167/168 -> 154/154 ms; served beside vLLM (fp8 KV on both, vLLM's client, one at a time) the 32k
# prompt's mean TTFT went from 1.64x vLLM's (lease_s38) to 0.94x, the 8k prompt's 0.84x. PDSERVE_PREFILL_LIBRARY_FP8=0
# (or bench_steps.py --no-library-fp8-pools) keeps those rows on the Triton kernel.
FP8_POOLS = envs.prefill_library_fp8(True)
# STRIDED_INPUTS: a call input that needs no padding (its length is already the call's size) goes to cuDNN as it lies
# in the step's fused q/k/v projection (each token's heads one projection row apart, the head dim contiguous), not
# copied into a packed buffer first (the warm-up builds its plans on views of such a buffer either way). Why: a fresh
# 8192-token prompt of dummy Qwen3-30B-A3B ran 144 copy kernels (3 a layer), 5.2 of its 153 ms of kernels
# (benchmarks/lease_s39/s39d); every chunk of a long prompt on a prefix at a PREFIX_BUCKET multiple needs no padding
# either. Measured (lease_s40/s40c, arms off, on, off, on): that prompt 153.6/152.3 -> 149.0/149.6 ms a step, dummy
# Qwen3-8B's 222.6/225.2 -> 216.5/218.9 ms; chunks on a prefix 0.8-1.4 % faster. bench_steps.py
# --no-library-strided-inputs packs them again.
STRIDED_INPUTS = True


@lru_cache(maxsize=8)
def _device_ok(index: int) -> bool:
    if not (torch.cuda.is_available() and torch.backends.cudnn.is_available()):
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether this process may run prefill rows through cuDNN on `device` (PDSERVE_PREFILL_LIBRARY, the GPU)."""
    if device.type != "cuda" or envs.prefill_library() == "none":
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


_planned_shapes: set[tuple[int, int, int]] = set()  # bucketed_shapes(...)[:3] of the rows run in this process


def row_qualifies(q_len: int, ctx: int) -> bool:
    """Whether cuDNN takes a prefill row: a long one (a plan for a new shape pays for itself), or a chunk on a prefix
    of at least MIN_PLANNED tokens whose calls' shapes were run before in this process (no plan to build)."""
    if q_len >= (MIN_FRESH if ctx == 0 else MIN_CHUNK):
        return True
    return ctx > 0 and q_len >= MIN_PLANNED and bucketed_shapes(q_len, ctx)[:3] in _planned_shapes


def pool_ok(kv_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the library takes rows of a pool of `kv_dtype` for a model of `dtype`: the model's own dtype, or fp8
    where FP8_POOLS says so (the prefix is then dequantized as it is gathered)."""
    return kv_dtype == dtype or (FP8_POOLS and is_fp8(kv_dtype))


def takes_model(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the library may take prefill rows of a model of `dtype` and `head_dim` over a pool of `kv_dtype` on
    `device` at all (library_rows decides a step's rows; the KV sizing and the warm-up ask this)."""
    return dtype in DTYPES and pool_ok(kv_dtype, dtype) and head_dim <= MAX_HEAD_DIM and enabled(device)


def library_rows(meta: AttentionMetadata, q: torch.Tensor, kv_layer: torch.Tensor, k_new: torch.Tensor | None,
                 sliding_window: int | None, softcap: float | None) -> list[tuple[int, int, int, int]] | None:
    """[(row, first token, new tokens, prefix length)] of every prefill row of the step, when all of them
    qualify and the step's shapes allow the library; None otherwise (the Triton kernel takes the step). The
    answer for the rows is kept on `meta` (every layer of the step asks)."""
    if (k_new is None or sliding_window or softcap is not None
            or not takes_model(q.device, q.dtype, kv_layer.dtype, q.shape[-1])):
        return None
    if meta.library is None:
        meta.library = (_qualifying_rows(meta.query_start_loc, meta.seq_lens),)
    return meta.library[0]


def _qualifying_rows(qsl: list[int], lens: list[int]) -> list[tuple[int, int, int, int]] | None:
    rows = []
    for i in range(len(lens)):
        q_len = qsl[i + 1] - qsl[i]
        if q_len <= 1:
            continue
        ctx = lens[i] - q_len
        if not row_qualifies(q_len, ctx):
            return None
        rows.append((i, qsl[i], q_len, ctx))
    return rows or None


def transient_bytes(max_tokens: int, max_model_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """An upper bound of what one layer's library attention holds beside the layer's own tensors, for up to
    max_tokens new tokens on a prefix of up to max_model_len: the gathered prefix (K and V), then either the
    causal call's padded inputs or the unmasked call's padded queries, each beside the outputs and fp32
    log-sum-exps live at that point (library_prefill's order)."""
    es = torch.empty((), dtype=dtype).element_size()
    kvh = num_q_heads if _expand_kv else num_kv_heads  # repeated K/V (see _cudnn)
    rows_b = max_tokens + PREFIX_BUCKET + QUERY_BUCKET  # the causal call's padded size
    rows_a = max_tokens + QUERY_BUCKET  # the unmasked call's padded queries

    def out(rows: int) -> int:
        return rows * num_q_heads * (head_dim * es + 4)

    prefix = 2 * max_model_len * kvh * head_dim * es
    causal = rows_b * (num_q_heads + 2 * kvh) * head_dim * es + out(rows_b)
    unmasked = rows_a * num_q_heads * head_dim * es + out(rows_a) + out(rows_b)
    return prefix + max(causal, unmasked) + (4 << 20)  # + slack for the allocator's rounding of a few tensors


_expand_kv = False  # set if this torch's cuDNN op refused grouped K/V heads or strided views (then: repeated, copied)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention of [1, H, L, D] views (top-left causal), with its log-sum-exps when `lse`."""
    global _expand_kv
    if not _expand_kv:
        try:
            return _call_watched(q, k, v, scale, causal, lse)
        except RuntimeError as e:
            log.warning("cuDNN attention refused grouped K/V heads as views (%s); repeating them instead", e)
            _expand_kv = True
    g = q.shape[1] // k.shape[1]
    return _call_watched(q.contiguous(), k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale, causal, lse)


def _call_watched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One cuDNN call; the first of its shape is timed on the host for plan_watch (the plan is built then)."""
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    key = ((tuple(q.shape), q.stride()), (tuple(k.shape), k.stride()), (tuple(v.shape), v.stride()), causal, lse,
           q.dtype)
    if PLANS.seen(key):
        out = op(q, k, v, None, lse, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    t0 = time.perf_counter()
    out = op(q, k, v, None, lse, 0.0, causal, False, scale=scale)
    PLANS.record(key, time.perf_counter() - t0)
    return out[0], out[1]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] rows -> a [1, H, L, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def gather_prefix(kv_layer: torch.Tensor, block_table_row: torch.Tensor, ctx: int, dtype: torch.dtype | None = None,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ctx tokens' K and V of one row, [ctx, Hk, D] each (contiguous), copied out of the pool
    ([num_blocks, 2, block_size, Hk, D]) in block-table order. An fp8 pool's values come out in `dtype`, times
    k_scale / v_scale (where given) in fp32, as the reference dequantizes them."""
    bs, hk, d = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    nblk = -(-ctx // bs)
    fp8 = is_fp8(kv_layer.dtype)
    out_dtype = dtype if fp8 and dtype is not None else kv_layer.dtype
    if use_fused(kv_layer) and bs & (bs - 1) == 0 and kv_layer.stride(-1) == 1:
        table = block_table_row[:nblk].to(device=kv_layer.device, dtype=torch.int32).contiguous()
        out = torch.empty((2, nblk * bs, hk, d), dtype=out_dtype, device=kv_layer.device)
        if nblk:
            has_ks, has_vs = fp8 and k_scale is not None, fp8 and v_scale is not None
            _gather_blocks_kernel[(nblk, 2)](
                kv_layer, table, out, k_scale if has_ks else table, v_scale if has_vs else table,
                kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3), out.stride(0),
                HK=hk, D=d, BS=bs, BLOCK_H=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d),
                DEQUANT=out_dtype != kv_layer.dtype, HAS_KS=has_ks, HAS_VS=has_vs, num_warps=4)
        return out[0, :ctx], out[1, :ctx]
    blocks = block_table_row[:nblk].long()
    k = kv_layer[:, 0].index_select(0, blocks).view(-1, hk, d)[:ctx]
    v = kv_layer[:, 1].index_select(0, blocks).view(-1, hk, d)[:ctx]
    if out_dtype != kv_layer.dtype:
        k, v = (x.float() * s.float() if s is not None else x.float() for x, s in ((k, k_scale), (v, v_scale)))
        k, v = k.to(out_dtype), v.to(out_dtype)
    return k, v


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _packed(x: torch.Tensor) -> bool:
    """Rows of [L, H, D] whose heads lie back to back (row stride H x D): as a bucketed call takes its input."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and x.stride(-3) == x.shape[-2] * x.shape[-1]


def _as_is(x: torch.Tensor) -> bool:
    """Whether a call may take rows of [L, H, D] where they lie: heads packed, or (STRIDED_INPUTS) any layout with
    the head dim contiguous and 16-byte aligned rows and heads (a view of the step's fused q/k/v projection)."""
    if _packed(x):
        return True
    return (STRIDED_INPUTS and x.stride(-1) == 1 and (x.stride(-2) * x.element_size()) % 16 == 0
            and (x.stride(-3) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


def _padded(rows: list[tuple[torch.Tensor, int]], length: int) -> torch.Tensor:
    """[length, H, D]: each (x, at) placed at row `at` (in order, not overlapping), zeros in the rows none covers; a
    bucketed call's input. One x that already fills the length, in a layout the call takes (_as_is), is returned
    as it is."""
    x0 = rows[0][0]
    if len(rows) == 1 and rows[0][1] == 0 and x0.shape[0] == length and _as_is(x0):
        return x0
    buf = torch.empty((length, *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
    end = 0
    for x, at in rows:
        if at > end:
            buf[end:at].zero_()
        buf[at: at + x.shape[0]].copy_(x)
        end = at + x.shape[0]
    if end < length:
        buf[end:].zero_()
    return buf


def bucketed_shapes(q_len: int, ctx: int) -> tuple[int, int, int, int]:
    """(prefix keys of the unmasked call, its padded query rows, the causal call's padded size, the prefix tokens
    that go to the causal call): what library_prefill calls cuDNN with for a row (module docstring: why)."""
    c0 = (ctx // PREFIX_BUCKET) * PREFIX_BUCKET
    r = ctx - c0
    return c0, _round_up(q_len, QUERY_BUCKET), _round_up(r + q_len, QUERY_BUCKET), r


def library_prefill(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    rows: list[tuple[int, int, int, int]], scale: float, k_new: torch.Tensor, v_new: torch.Tensor,
                    out: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Attention of the given prefill rows (library_rows) into their rows of `out` ([T, Hq, D]); an fp8 pool's
    prefix is dequantized into q's dtype as it is gathered (k_scale, v_scale)."""
    for row, q0, q_len, ctx in rows:
        kp = vp = None
        if ctx:
            kp, vp = gather_prefix(kv_layer, meta.block_tables[row], ctx, q.dtype, k_scale, v_scale)
        attend_row(q[q0: q0 + q_len], k_new[q0: q0 + q_len], v_new[q0: q0 + q_len], kp, vp, scale,
                   out[q0: q0 + q_len])


def attend_row(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, kp: torch.Tensor | None,
               vp: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    """One row: new tokens' q/k/v ([q_len, H, D] rows), the gathered prefix's K/V ([ctx, Hk, D], None without a
    prefix) -> out ([q_len, Hq, D])."""
    from pdserve.ops.attention.merge import merge_two

    hq, q_len = qr.shape[1], qr.shape[0]
    ctx = 0 if kp is None else kp.shape[0]
    c0, qa, sb, r = bucketed_shapes(q_len, ctx)
    _planned_shapes.add((c0, qa, sb))
    # the causal call: r prefix tokens (dummy query rows for them), the new tokens, zero padding at the end
    qb = _padded([(qr, r)], sb)
    kb = _padded([(kp[c0:], 0), (kr, r)] if r else [(kr, 0)], sb)
    vb = _padded([(vp[c0:], 0), (vr, r)] if r else [(vr, 0)], sb)
    ob, lb = _cudnn(_heads_first(qb), _heads_first(kb), _heads_first(vb), scale, True, c0 > 0)
    del kb, vb
    if c0 == 0:
        out.copy_(ob[0, :, r: r + q_len].transpose(0, 1))
        return
    qa_buf = qb if r == 0 and sb == qa else _padded([(qr, 0)], qa)  # a whole chunk's queries: one copy for both
    del qb
    oa, la = _cudnn(_heads_first(qa_buf), _heads_first(kp[:c0]), _heads_first(vp[:c0]), scale, False, True)
    del qa_buf
    merge_two(oa[0, :, :q_len], la.reshape(hq, qa)[:, :q_len], ob[0, :, r: r + q_len],
              lb.reshape(hq, sb)[:, r: r + q_len], out)


def warm_shapes(max_tokens: int, max_model_len: int, chunk: int = 0) -> list[tuple[int, int]]:
    """(new tokens, prefix) of the rows whose call shapes start-up builds, ahead of the first requests: a fresh
    prompt in each query bucket from MIN_FRESH to max_tokens, and a chunk of max_tokens (from MIN_CHUNK), and of
    `chunk` tokens (the engine's max_long_prefill_tokens, when set, from MIN_PLANNED), on each multiple of
    PREFIX_BUCKET a prompt of max_model_len reaches (at most WARM_MAX_PREFIXES of them), and the causal sizes of a full
    chunk on an unaligned prefix (shifted_chunks). The rest (longer prefixes, other lengths) build on first use when
    they are long enough (row_qualifies)."""
    fresh = [(n, 0) for n in range(_round_up(MIN_FRESH, QUERY_BUCKET), max_tokens + 1, QUERY_BUCKET)]
    if max_tokens >= MIN_FRESH and (not fresh or fresh[-1][0] != max_tokens):
        fresh.append((max_tokens, 0))
    chunks = []
    for n in sorted({max_tokens} | ({chunk} if 0 < chunk < max_tokens else set()), reverse=True):
        if n >= (MIN_CHUNK if n == max_tokens else MIN_PLANNED):
            top = min(max_model_len - n, WARM_MAX_PREFIXES * PREFIX_BUCKET)
            chunks += [(n, c) for c in range(PREFIX_BUCKET, top + 1, PREFIX_BUCKET)]
    return fresh + chunks + shifted_chunks(max_tokens, max_model_len)


def shifted_chunks(max_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """Rows whose causal calls have the sizes a full chunk meets on a prefix that is not a multiple of PREFIX_BUCKET
    (decode rows beside a long prompt shift its chunks): the prefix's r tokens past the bucket join the causal call,
    so it is up to PREFIX_BUCKET - 1 rows longer than the chunk. One row of max_tokens for each such size, on a
    prefix of one bucket and r tokens (the unmasked call is then a full chunk's on one bucket, built anyway)."""
    n = max_tokens
    if n < MIN_CHUNK or max_model_len < n + 2 * PREFIX_BUCKET:
        return []
    sizes = range(_round_up(n + 1, QUERY_BUCKET), _round_up(n + PREFIX_BUCKET - 1, QUERY_BUCKET) + 1, QUERY_BUCKET)
    return [(n, PREFIX_BUCKET + min(sb - n, PREFIX_BUCKET - 1)) for sb in sizes]


def warm_up(device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
            max_tokens: int, max_model_len: int, chunk: int = 0) -> int:
    """Build cuDNN's plans for `warm_shapes` (and compile the merge kernel) on zero inputs; returns how many rows
    ran (0 where the library is off or these shapes do not take it)."""
    if not takes_model(device, dtype, dtype, head_dim):  # its inputs are in the model's dtype (a gathered prefix's)
        return 0
    shapes = warm_shapes(max_tokens, max_model_len, chunk)
    if not shapes:
        return 0
    longest_new = max(n for n, _ in shapes)
    # q, k and v as a step's are: views of one fused projection output (the plans of STRIDED_INPUTS' calls)
    qkv = torch.zeros((longest_new, num_q_heads + 2 * num_kv_heads, head_dim), dtype=dtype, device=device)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for n, c in shapes:
        kp = vp = None
        if c:  # as gather_prefix returns it: a whole-block copy, cut to the prefix
            kp = torch.zeros((c, num_kv_heads, head_dim), dtype=dtype, device=device)
            vp = torch.zeros_like(kp)
        attend_row(q[:n], k[:n], v[:n], kp, vp, 1.0, out[:n])
        del kp, vp
    torch.cuda.synchronize(device)
    return len(shapes)

"""Long prefill rows through cuDNN's fused attention (the kernel behind torch SDPA's cuDNN backend), chosen by
measurement; the Triton kernel (prefill.py) stays the path that always works, and the torch reference the oracle.

Why: on an H200 with dummy Qwen3-8B's heads (32 x 128 over 8 KV heads, bf16), the Triton prefill kernel runs at
400-450 TFLOP/s on long rows, about FlashAttention-2's speed, and cuDNN's at 575-615 (benchmarks/lease_s16,
probe_sdpa_backends.py): 894 vs 1281 us for a fresh 8192-token prompt, 6.7 vs 9.7 ms for an 8192-token chunk on a
24576-token prefix. vLLM runs FlashAttention 3 there, which is what made the 32k prompt's TTFT 1.12-1.19x vLLM's.

How, for one prefill row of q_len new tokens on ctx tokens already in the pool:
- ctx == 0: one causal call over the step's own K/V (k_new/v_new, views of the fused projection; no copy).
- ctx > 0: the prefix's K and V are gathered out of the pool (its blocks, in block-table order: 4 KiB a token for
  8 x 128 bf16 heads), then two calls, the new tokens against the prefix (no mask) and against themselves
  (causal), each with its log-sum-exp; `merge_two` combines them, a Triton kernel that writes the output rows in
  place. torch's single call with a lower-right causal mask ran 1.6-1.7x slower than the two (it materializes the
  mask), and 1.5x slower than Triton on a 2048-token chunk on a 2048 prefix, hence the row rule below.
The calls are torch.ops.aten._scaled_dot_product_cudnn_attention, the op torch's SDPA dispatches to; grouped
query heads go to cuDNN as they are (no repeat of K/V).

Which rows: a step uses the library only if every prefill row in it qualifies (decode rows still go to the Triton
decode kernel): a fresh prompt of at least MIN_FRESH tokens, or a chunk of at least MIN_CHUNK tokens on a prefix;
bf16/fp16, an unquantized pool, head dim <= 128, no sliding window or softcapping, the step's K/V given, a CUDA
device of compute capability 9.0 or later with cuDNN. `PDSERVE_PREFILL_LIBRARY=none` turns it off.

Memory: the gathered prefix, both partial outputs and their log-sum-exps live for one layer's attention;
`transient_bytes` bounds them, and the KV sizing probe (whose short rows never take this path) adds that bound to
the step peak it measured.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from pdserve import envs
from pdserve.ops.attention.common import is_fp8
from pdserve.ops.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

MIN_FRESH = 2048  # a whole prompt: cuDNN 87 vs Triton 116 us at 2048 tokens, 14.7 vs 19.5 ms at 32768 (H200)
MIN_CHUNK = 8192  # a chunk on a prefix: 1.32-1.44x faster at 8192 on 8k-24k prefixes, 1.5x slower at 2048 on 2048
MAX_HEAD_DIM = 128  # measured at 128
DTYPES = (torch.bfloat16, torch.float16)


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


def row_qualifies(q_len: int, ctx: int) -> bool:
    return q_len >= (MIN_FRESH if ctx == 0 else MIN_CHUNK)


def library_rows(meta: AttentionMetadata, q: torch.Tensor, kv_layer: torch.Tensor, k_new: torch.Tensor | None,
                 sliding_window: int | None, softcap: float | None) -> list[tuple[int, int, int, int]] | None:
    """[(row, first token, new tokens, prefix length)] of every prefill row of the step, when all of them
    qualify and the step's shapes allow the library; None otherwise (the Triton kernel takes the step). The
    answer for the rows is kept on `meta` (every layer of the step asks)."""
    if (k_new is None or sliding_window or softcap is not None or q.dtype not in DTYPES
            or kv_layer.dtype != q.dtype or is_fp8(kv_layer.dtype) or q.shape[-1] > MAX_HEAD_DIM
            or not enabled(q.device)):
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
    """An upper bound of what one layer's library attention holds beside the layer's own tensors: the gathered
    prefix (K and V, at most max_model_len tokens, whole blocks), both partial outputs and their fp32
    log-sum-exps, for up to max_tokens new tokens."""
    es = torch.empty((), dtype=dtype).element_size()
    kv_heads = num_q_heads if _expand_kv else num_kv_heads  # repeated K/V (see _cudnn): the step's own too
    prefix = 2 * max_model_len * kv_heads * head_dim * es
    parts = 2 * max_tokens * num_q_heads * (head_dim * es + 4)
    repeated = 2 * max_tokens * num_q_heads * head_dim * es if _expand_kv else 0
    return prefix + parts + repeated + (4 << 20)  # + slack for the allocator's rounding of a handful of tensors


_expand_kv = False  # set if this torch's cuDNN op refused grouped K/V heads or strided views (then: repeated, copied)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention of [1, H, L, D] views (top-left causal), with its log-sum-exps when `lse`."""
    global _expand_kv
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    if not _expand_kv:
        try:
            out = op(q, k, v, None, lse, 0.0, causal, False, scale=scale)
            return out[0], out[1]
        except RuntimeError as e:
            log.warning("cuDNN attention refused grouped K/V heads as views (%s); repeating them instead", e)
            _expand_kv = True
    g = q.shape[1] // k.shape[1]
    out = op(q.contiguous(), k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, lse, 0.0, causal, False,
             scale=scale)
    return out[0], out[1]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] rows -> a [1, H, L, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def gather_prefix(kv_layer: torch.Tensor, block_table_row: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ctx tokens' K and V of one row, [ctx, Hk, D] each, copied out of the pool
    ([num_blocks, 2, block_size, Hk, D]) in block-table order."""
    bs, hk, d = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    blocks = block_table_row[: -(-ctx // bs)].long()
    k = kv_layer[:, 0].index_select(0, blocks).view(-1, hk, d)[:ctx]
    v = kv_layer[:, 1].index_select(0, blocks).view(-1, hk, d)[:ctx]
    return k, v


def library_prefill(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    rows: list[tuple[int, int, int, int]], scale: float, k_new: torch.Tensor, v_new: torch.Tensor,
                    out: torch.Tensor) -> None:
    """Attention of the given prefill rows (library_rows) into their rows of `out` ([T, Hq, D])."""
    from pdserve.ops.attention.merge import merge_two

    for row, q0, q_len, ctx in rows:
        qq = _heads_first(q[q0: q0 + q_len])
        kn, vn = _heads_first(k_new[q0: q0 + q_len]), _heads_first(v_new[q0: q0 + q_len])
        if ctx == 0:
            o, _ = _cudnn(qq, kn, vn, scale, True, False)
            out[q0: q0 + q_len].copy_(o[0].transpose(0, 1))
            continue
        kp, vp = gather_prefix(kv_layer, meta.block_tables[row], ctx)
        o1, l1 = _cudnn(qq, _heads_first(kp), _heads_first(vp), scale, False, True)
        del kp, vp
        o2, l2 = _cudnn(qq, kn, vn, scale, True, True)
        hq = q.shape[1]
        merge_two(o1[0], l1.reshape(hq, q_len), o2[0], l2.reshape(hq, q_len), out[q0: q0 + q_len])

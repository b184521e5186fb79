"""CUDA graphs of the model's forward: full graphs for pure decode batches, piecewise graphs for any batch up to a
token count (decode rows and prefill chunks mixed).

Piecewise: the forward is captured once per padded token count N with a stand-in attention backend
(`SplitAtAttention`). At each layer's attention call it copies q/k/v into static buffers, ends the current graph,
records the call and begins the next graph; the layer goes on reading the static output buffer. A step then
replays piece 0, runs layer 0's attention eagerly on the real rows (any backend, any metadata: prefill chunks,
prefix hits, fp8 pools), copies its output into the static buffer, replays piece 1, and so on. Padded rows never
reach attention, so they write no KV. All graphs share one memory pool and are replayed in capture order.

Without CUDA, `emulate=True` runs the same padded static-buffer data flow eagerly (tests of the bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.forward_context import ForwardContext, forward_context, layer_view


def decode_graph_sizes(max_batch: int) -> list[int]:
    """Batch sizes that get a full decode graph: 1, 2, 4, 8, then every 16 up to max_batch."""
    return sorted({s for s in [1, 2, 4, 8, *range(16, max_batch + 1, 16), max_batch] if s <= max_batch})


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts that get a piecewise graph: 8, every 16 to 128, every 32 to 256, then +25% rounded up to a
    multiple of 64 (padding stays under ~25%), and max_tokens itself."""
    sizes = [8, *range(16, 129, 16)]
    s = 128
    while s < max_tokens:
        s = s + 32 if s < 256 else -(-(s + s // 4) // 64) * 64
        sizes.append(s)
    return sorted({min(x, max_tokens) for x in sizes})


@dataclass
class AttnBuffers:
    """Static q/k/v/o of the widest layer, shared by every layer and size (pieces run one after another)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor

    @classmethod
    def for_model(cls, max_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> AttnBuffers:
        nq, nk = max_tokens * num_heads * head_dim, max_tokens * num_kv_heads * head_dim
        return cls(*(torch.zeros(n, dtype=dtype, device=device) for n in (nq, nk, nk, nq)))

    @staticmethod
    def view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if like.numel() > buf.numel() or like.dtype != buf.dtype:
            raise ValueError(f"attention input {tuple(like.shape)} {like.dtype} does not fit the static buffers")
        return buf[: like.numel()].view(like.shape)


@dataclass
class AttnCall:
    """One layer's attention as recorded during capture; replayed eagerly on the real rows."""

    q: torch.Tensor  # [N, Hq, D] static
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    kv_layer: torch.Tensor
    scale: float
    sliding_window: int | None
    softcap: float | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def run(self, backend, meta, t: int) -> None:
        o = backend.forward(self.q[:t], self.k[:t], self.v[:t], self.kv_layer, meta, self.scale, self.sliding_window,
                            self.softcap, k_scale=self.k_scale, v_scale=self.v_scale)
        self.o[:t].copy_(o)


class SplitAtAttention:
    """The attention backend during a piecewise capture (or its eager emulation): copies q/k/v into the static
    buffers, calls `on_split` (ends one graph, begins the next), records the call, returns the static output.
    With `run=(backend, meta, t, after_layer)` it attends at once instead (emulation)."""

    name = "split"

    def __init__(self, bufs: AttnBuffers, on_split=None, run: tuple | None = None):
        self.bufs = bufs
        self.on_split = on_split
        self.run_now = run
        self.calls: list[AttnCall] = []

    def forward(self, q, k, v, kv_layer, meta, scale, sliding_window=None, softcap=None, k_scale=None, v_scale=None):
        b = self.bufs
        call = AttnCall(b.view(b.q, q), b.view(b.k, k), b.view(b.v, v), b.view(b.o, q), kv_layer, scale,
                        sliding_window, softcap, k_scale, v_scale)
        call.q.copy_(q)
        call.k.copy_(k)
        call.v.copy_(v)
        if self.on_split is not None:
            self.on_split()
        if self.run_now is not None:
            backend, real_meta, t, after_layer = self.run_now
            call.run(backend, real_meta, t)
            if after_layer is not None:
                after_layer(len(self.calls))
        self.calls.append(call)
        return call.o


class PiecewiseGraph:
    """The pieces of one padded token count, captured around each attention call."""

    def __init__(self, model, kv_cache: torch.Tensor, bufs: AttnBuffers, ids: torch.Tensor, positions: torch.Tensor,
                 pool, stream: torch.cuda.Stream):
        self.size = ids.shape[0]
        self.graphs: list[torch.cuda.CUDAGraph] = []

        def begin():
            g = torch.cuda.CUDAGraph()
            self.graphs.append(g)
            g.capture_begin(pool=pool, capture_error_mode="thread_local")

        def split():
            self.graphs[-1].capture_end()
            begin()

        self.ids_ptr = ids.data_ptr()
        torch.cuda.synchronize()  # the inputs' copy (current stream) has landed before the side stream reads them
        warm = SplitAtAttention(bufs)  # compiles kernels for this shape outside any capture (no attention)
        with torch.cuda.stream(stream), forward_context(ForwardContext(None, kv_cache, warm)):
            model(ids, positions)
        torch.cuda.synchronize()
        rec = SplitAtAttention(bufs, on_split=split)
        with torch.cuda.stream(stream), forward_context(ForwardContext(None, kv_cache, rec)):
            begin()
            try:
                self.hidden = model(ids, positions)
            finally:
                self.graphs[-1].capture_end()
        torch.cuda.synchronize()
        self.calls = rec.calls
        for i, call in enumerate(self.calls):
            if call.kv_layer.data_ptr() != layer_view(kv_cache, i).data_ptr():
                raise RuntimeError("piecewise capture: attention calls must come one per layer, in layer order")

    def replay(self, ids: torch.Tensor, backend, meta, t: int, after_layer=None) -> torch.Tensor:
        """Final hidden states of all `size` rows (rows >= t are padding); `ids` must be the captured input."""
        if ids.data_ptr() != self.ids_ptr:
            raise RuntimeError("piecewise graph replayed with inputs at another address than captured")
        for i, call in enumerate(self.calls):
            self.graphs[i].replay()
            call.run(backend, meta, t)
            if after_layer is not None:
                after_layer(i)
        self.graphs[-1].replay()
        return self.hidden


class DecodeGraph:
    """One full graph of a decode batch size: embedding to final norm, attention included."""

    def __init__(self, model, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor, pool,
                 stream: torch.cuda.Stream):
        torch.cuda.synchronize()  # the inputs' copy (current stream) has landed before the side stream reads them
        with torch.cuda.stream(stream), forward_context(ctx):
            model(ids, positions)  # warm-up: Triton compiles outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), forward_context(ctx):
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.hidden = model(ids, positions)
            finally:
                self.graph.capture_end()
        torch.cuda.synchronize()
        self.ids_ptr = ids.data_ptr()

    def replay(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.data_ptr() != self.ids_ptr:
            raise RuntimeError("decode graph replayed with inputs at another address than captured")
        self.graph.replay()
        return self.hidden

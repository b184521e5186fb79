"""Runs a scheduled batch on the device: builds its inputs (one host-to-device copy), runs the model — a full CUDA
graph for a pure decode batch, piecewise graphs for a mixed batch up to a token count, eagerly otherwise — takes
the logits of the rows that reached the end of their known tokens, and samples them.

The forward itself never synchronizes with the host; sampling's copy of the tokens is the step's one sync.
A step is `launch` (inputs, forward, sampling: all queued on the device; the sampled ids stay there and a
non-blocking copy to pinned host memory is started) then `collect` (waits for that copy): with async scheduling the
engine core schedules and launches the next step in between. The next step's rows that decode on a token not yet
on the host carry placeholders, filled on the device from the last launched step's ids (`last_tokens`).

Tensor parallelism: every rank has a runner over its model shard and KV pool (its KV heads, the same block ids).
Rank 0's runner plans each step and hands the plan to `step_sink` (the executor sends it to the other ranks) before
running it; the other ranks run the same plan (`run_plan`), so every rank replays the same graph or eager path and
meets the same collectives. Rank 0 alone gets logits and samples.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.cuda_graphs import (
    AttnBuffers,
    DecodeGraph,
    PiecewiseGraph,
    SplitAtAttention,
    decode_graph_sizes,
    mixed_graph_sizes,
)
from pdserve.engine.request import Request
from pdserve.engine.sampler import PendingSample, SampleResult, sample_async
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.step_inputs import (
    BlockRows,
    RowDelta,
    RowMirror,
    Staging,
    StepArrays,
    StepInputs,
    StepPlan,
    fill_arrays,
    gather,
    layout_bytes,
)
from pdserve.model.forward_context import ForwardContext, forward_context
from pdserve.model.shapes import head_dim
from pdserve.ops.attention import AttentionMetadata, get_backend
from pdserve.parallel.ranges import local_kv_heads

log = logging.getLogger(__name__)

MAX_GRAPH_TOKENS = 1024  # mixed batches above this run eagerly: their GPU time dwarfs launch costs
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for `--kv-cache-dtype` (config.KV_CACHE_DTYPES): auto is the model's."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return _KV_DTYPES[kv_cache_dtype]


def kv_cache_shape(cfg, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
    """The KV pool of one rank: `[num_blocks, kv_heads, layers, 2, block_size, head_dim]` over its own KV heads (all of
    them at tp_size 1). Block-major, so a block is one contiguous run for the transfer engine, and head-major inside
    a block, so any range of heads is one contiguous run too: what moves KV between instances of different
    tensor-parallel sizes without small copies. The one place the layout is decided; attention sees one layer
    through `model.forward_context.layer_view` and kernels take strides from the tensor."""
    heads = local_kv_heads(cfg.num_key_value_heads, tp_size)
    return (num_blocks, heads, cfg.num_hidden_layers, 2, block_size, head_dim(cfg))


def block_bytes(cfg, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block of one rank's pool (all layers, K and V) in the pool's dtype."""
    n = 1
    for s in kv_cache_shape(cfg, 1, block_size, tp_size):
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass
class StepHandle:
    """A launched step: the requests of its sampled rows (in row order) and their tokens on the way to the host."""

    reqs: list[Request]
    pending: PendingSample | None  # None: no row was sampled


class ModelRunner:
    def __init__(self, model, cfg, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 attention_backend: str = "auto", kv_cache_dtype: torch.dtype | None = None, tp_size: int = 1,
                 pool_alloc: str = "torch"):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        # one extra block past the pool's range: padded rows of a captured decode graph write there
        self.scratch_block = num_blocks
        self.tp_size = tp_size
        shape = kv_cache_shape(cfg, num_blocks + 1, block_size, tp_size)
        if pool_alloc == "torch" or device.type != "cuda":
            self.kv_cache, self.pool_alloc = torch.zeros(shape, dtype=self.kv_dtype, device=device), "torch"
        else:  # CUDA VMM (pdserve.kv.vmm): a peer can map it over cuda_ipc however GPUs are made visible to it
            from pdserve.kv.vmm import pool_zeros

            self.kv_cache, self.pool_alloc = pool_zeros(shape, self.kv_dtype, device, pool_alloc)
        self.backend = get_backend(attention_backend, device)
        self.staging = Staging(device, 1 << 20)  # eager steps (grows)
        self.block_rows = BlockRows()  # block tables converted to numpy once per new block (rank 0)
        self.row_mirror = RowMirror()  # the same rows rebuilt from rank 0's step plans (other ranks)
        self.step_sink = None  # rank 0 of a TP group: called with each step's StepPlan before the step runs
        self.graph_staging: Staging | None = None  # graph steps: fixed addresses
        self.decode_graphs: dict[int, DecodeGraph] = {}
        self.mixed_graphs: dict[int, PiecewiseGraph | None] = {}  # None: emulated (no CUDA)
        self.decode_sizes: list[int] = []
        self.mixed_sizes: list[int] = []
        self.graph_width = 0
        self.graph_max_len = 0
        self.attn_bufs: AttnBuffers | None = None
        self.step_counts = {"decode_graph": 0, "mixed_graph": 0, "eager": 0}  # steps run each way
        self.use_graphs = True  # False: run every step eagerly though graphs were captured (A/B benchmarks)
        self.use_full_decode_graphs = True  # False: decode batches replay piecewise graphs too (A/B benchmarks)
        self.last_tokens: torch.Tensor | None = None  # the last launched step's sampled ids, on this device
        # tensor parallelism: the group's broadcast from rank 0 (set by the Worker at size > 1), and whether rank 0
        # shares each step's sampled ids with the other ranks (the engine core turns it on for async scheduling)
        self.tp_broadcast = None
        self.share_tokens = False

    # ---- graphs
    def full_decode_graphs_supported(self) -> bool:
        """Full graphs put attention inside the capture: only the Triton decode kernel on a model-dtype pool."""
        return self.backend.name == "triton"

    @torch.inference_mode()
    def capture_graphs(self, max_batch: int, max_model_len: int, max_tokens: int = 512,
                       emulate: bool = False) -> None:
        """Capture full decode graphs for batch sizes up to `max_batch` and piecewise graphs for token counts up to
        min(max_tokens, MAX_GRAPH_TOKENS). On CPU only with `emulate` (the same data flow, run eagerly)."""
        if self.device.type != "cuda" and not emulate:
            return
        t0 = time.time()
        cfg = self.cfg
        self.graph_width = -(-max_model_len // self.block_size)
        self.graph_max_len = max_model_len
        self.decode_sizes = decode_graph_sizes(max_batch) if self.full_decode_graphs_supported() or emulate else []
        self.mixed_sizes = mixed_graph_sizes(min(max_tokens, MAX_GRAPH_TOKENS))
        w = self.graph_width
        need = max([layout_bytes(s, s, s, w, s, 0, s) for s in self.decode_sizes]  # placeholders: one per row
                   + [layout_bytes(n, n, n, w, n, n, n) for n in self.mixed_sizes])  # tiles: at most one per token
        self.graph_staging = Staging(self.device, need, growable=False)
        self.attn_bufs = AttnBuffers.for_model(self.mixed_sizes[-1], cfg.num_attention_heads // self.tp_size,
                                               local_kv_heads(cfg.num_key_value_heads, self.tp_size), head_dim(cfg),
                                               self.dtype, self.device)
        if emulate:
            self.mixed_graphs = {n: None for n in self.mixed_sizes}
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        empty = gather([], [])
        for s in reversed(self.decode_sizes):  # largest first: smaller graphs reuse its memory
            inp = self._graph_inputs(empty, [], s)
            ctx = ForwardContext(self._meta(inp, s), self.kv_cache, self.backend)
            self.decode_graphs[s] = DecodeGraph(self.model, ctx, inp.ids, inp.positions, pool, stream)
        for n in reversed(self.mixed_sizes):
            inp = fill_arrays(self.graph_staging, empty, [], self.block_size, pad_ids=n)
            self.mixed_graphs[n] = PiecewiseGraph(self.model, self.kv_cache, self.attn_bufs, inp.ids, inp.positions,
                                                  pool, stream)
        log.info("captured %d decode graphs (batch 1..%d) and piecewise graphs for %d token counts (8..%d) in %.1fs",
                 len(self.decode_sizes), self.decode_sizes[-1] if self.decode_sizes else 0, len(self.mixed_sizes),
                 self.mixed_sizes[-1], time.time() - t0)

    def _graph_inputs(self, a: StepArrays, rows: list, size: int, prev: torch.Tensor | None = None) -> StepInputs:
        """Decode graph inputs: every row padded to `size`; padded rows write their KV into the scratch block."""
        bs = self.block_size
        return fill_arrays(self.graph_staging, a, rows, bs, pad_ids=size, pad_rows=size, width=self.graph_width,
                           pad_slot=self.scratch_block * bs, pad_block=self.scratch_block, slots_padded=True,
                           prev_tokens=prev)

    def _meta(self, inp: StepInputs, graph_size: int = 0) -> AttentionMetadata:
        if graph_size:  # a decode graph serves every context length: loop bounds come from seq_lens_t
            return AttentionMetadata(list(range(graph_size + 1)), [self.graph_max_len] * graph_size,
                                     inp.block_tables, inp.slots, self.graph_max_len, True, inp.seq_lens_t,
                                     inp.qsl_t)
        qsl = inp.query_start_loc
        return AttentionMetadata(qsl, inp.seq_lens, inp.block_tables, inp.slots, max(inp.seq_lens), inp.decode_only,
                                 inp.seq_lens_t, inp.qsl_t, inp.prefill_tiles,
                                 any(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1)))

    # ---- one step
    def _plan(self, batch: ScheduledBatch, after_layer) -> tuple[str, int]:
        b, t = len(batch.requests), batch.total_tokens
        if not self.use_graphs:
            return "eager", 0
        if (after_layer is None and t == b and self.use_full_decode_graphs and self.decode_sizes
                and b <= self.decode_sizes[-1]):
            return "decode", next(s for s in self.decode_sizes if s >= b)
        if self.mixed_sizes and t <= self.mixed_sizes[-1]:
            return "mixed", next(s for s in self.mixed_sizes if s >= t)
        return "eager", 0

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch, after_layer=None) -> tuple[torch.Tensor | None, list[Request]]:
        """Rank 0: plan the step, send the plan to the other ranks (if any), run it; the sampled rows' logits."""
        kind, size = self._plan(batch, after_layer)
        arrays = gather(batch.requests, batch.num_new_tokens)
        delta = RowDelta() if self.step_sink is not None else None
        rows = self.block_rows.rows(batch.requests, delta)
        if self.step_sink is not None:
            self.step_sink(StepPlan.build(kind, size, arrays, delta, self.share_tokens))
        logits = self.run(kind, size, arrays, rows, after_layer)
        if logits is None:
            return None, []
        return logits, [r for r, s in zip(batch.requests, arrays.sampled.tolist()) if s]

    def run_plan(self, plan: StepPlan, after_layer=None) -> None:
        """Another rank: run rank 0's step (its logits stay with rank 0); `after_layer` as rank 0's (this rank's
        layer-by-layer KV push)."""
        rows = self.row_mirror.apply(plan.keys, plan.keep, plan.counts, plan.new_ids)
        self.run(plan.kind, plan.size, plan.arrays, rows, after_layer)
        if plan.share_tokens:  # rank 0's sampled ids of this step, for the next step's placeholders
            n = int(plan.arrays.sampled.sum())
            self.last_tokens = self.tp_broadcast(torch.empty(n, dtype=torch.long, device=self.device)) if n else None

    @torch.inference_mode()
    def run(self, kind: str, size: int, a: StepArrays, rows: list, after_layer=None) -> torch.Tensor | None:
        """One step's forward as planned (every rank alike): logits of the sampled rows (None when no row is sampled,
        and on ranks other than 0 of a tensor-parallel group)."""
        self.step_counts[f"{kind}_graph" if kind != "eager" else "eager"] += 1
        b = len(a.starts)
        prev = self.last_tokens
        if kind == "decode":
            inp = self._graph_inputs(a, rows, size, prev)
            if size in self.decode_graphs:
                hidden = self.decode_graphs[size].replay(inp.ids)
            else:  # emulation: the padded batch through the real backend, scratch writes included
                lens = inp.seq_lens + [1] * (size - b)  # host-side lengths, which a captured graph cannot have
                meta = AttentionMetadata(list(range(size + 1)), lens, inp.block_tables, inp.slots, max(lens), True,
                                         inp.seq_lens_t, inp.qsl_t)
                with forward_context(ForwardContext(meta, self.kv_cache, self.backend)):
                    hidden = self.model(inp.ids, inp.positions)
            hidden = hidden[:b] if inp.num_sampled == b else hidden.index_select(0, inp.sample_idx)
        elif kind == "mixed":
            inp = fill_arrays(self.graph_staging, a, rows, self.block_size, pad_ids=size, prev_tokens=prev)
            meta = self._meta(inp)
            graph = self.mixed_graphs[size]
            if graph is not None:
                hidden = graph.replay(inp.ids, self.backend, meta, inp.num_tokens, after_layer)
            else:
                split = SplitAtAttention(self.attn_bufs, run=(self.backend, meta, inp.num_tokens, after_layer))
                with forward_context(ForwardContext(None, self.kv_cache, split)):
                    hidden = self.model(inp.ids, inp.positions)
            hidden = hidden.index_select(0, inp.sample_idx)
        else:
            inp = fill_arrays(self.staging, a, rows, self.block_size, prev_tokens=prev)
            with forward_context(ForwardContext(self._meta(inp), self.kv_cache, self.backend, after_layer)):
                hidden = self.model(inp.ids, inp.positions, inp.sample_idx)
        if not inp.num_sampled:
            return None
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after_layer=None) -> StepHandle:
        """Queue the step's forward and sampling on the device and return without waiting for it (no host sync:
        the sampled ids stay on the device as `last_tokens`; their copy to the host is under way)."""
        logits, reqs = self.forward_logits(batch, after_layer)
        if logits is None:
            self.last_tokens = None
            return StepHandle([], None)
        pending = sample_async(logits, reqs)
        if self.share_tokens:
            self.tp_broadcast(pending.tokens)
        self.last_tokens = pending.tokens
        return StepHandle(reqs, pending)

    def collect(self, handle: StepHandle) -> SampleResult | None:
        """Wait for a launched step's sampled ids (and logprobs) on the host."""
        return handle.pending.result() if handle.pending is not None else None

    def execute(self, batch: ScheduledBatch, after_layer=None) -> tuple[list[Request], SampleResult | None]:
        """One step, waited for: launch then collect."""
        handle = self.launch(batch, after_layer)
        return handle.reqs, self.collect(handle)

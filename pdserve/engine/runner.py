"""Runs a scheduled batch on the device: flattens its tokens, builds attention metadata from block tables,
calls the model once, and samples where a request reached the end of its known tokens."""

from __future__ import annotations

import logging
import time

import torch

from pdserve.engine.forward_context import ForwardContext, forward_context
from pdserve.engine.request import Request
from pdserve.engine.sampler import SampleResult, sample
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.ops.attention import AttentionMetadata, get_backend

log = logging.getLogger(__name__)


def kv_cache_shape(cfg, num_blocks: int, block_size: int) -> tuple[int, ...]:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (num_blocks, cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, head_dim)


def block_bytes(cfg, block_size: int, dtype: torch.dtype) -> int:
    shape = kv_cache_shape(cfg, 1, block_size)
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model, cfg, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 attention_backend: str = "auto"):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        # one extra block past the pool's range: padded rows of a captured decode graph write there
        self.scratch_block = num_blocks
        self.kv_cache = torch.zeros(kv_cache_shape(cfg, num_blocks + 1, block_size), dtype=dtype, device=device)
        self.backend = get_backend(attention_backend, device)
        self._pin = device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _to_dev(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self._pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        max_blocks = 1
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            bids = req.block_ids
            slots.extend(bids[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            max_blocks = max(max_blocks, len(bids))
            if end == req.num_tokens:
                sample_idx.append(qsl[-1] - 1)
                sample_reqs.append(req)
        tables = [r.block_ids + [-1] * (max_blocks - len(r.block_ids)) for r in batch.requests]
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=self._to_dev(tables, torch.int32),
            slot_mapping=self._to_dev(slots, torch.int64),
            max_seq_len=max(seq_lens),
            decode_only=all(n == 1 for n in batch.num_new_tokens),
        )
        if self.device.type == "cuda":
            meta.seq_lens_t = self._to_dev(seq_lens, torch.int32)
            meta.query_start_loc_t = self._to_dev(qsl, torch.int32)
        ids = self._to_dev(input_ids, torch.long)
        pos = self._to_dev(positions, torch.long)
        return ids, pos, meta, sample_idx, sample_reqs

    # ---- CUDA graphs for decode steps: one launch per step instead of ~40 per layer
    @torch.inference_mode()
    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.backend.name != "triton":
            return
        t0 = time.time()
        bs = self.block_size
        self.g_max_blocks = (max_model_len + bs - 1) // bs
        self.g_max_len = max_model_len
        sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_batch + 1, 16), max_batch] if s <= max_batch})
        n = sizes[-1]
        dev = self.device
        self.g_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_slots = torch.full((n,), self.scratch_block * bs, dtype=torch.long, device=dev)
        self.g_tables = torch.full((n, self.g_max_blocks), self.scratch_block, dtype=torch.int32, device=dev)
        self.g_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._h_tables = torch.full((n, self.g_max_blocks), self.scratch_block, dtype=torch.int32).pin_memory()
        self._h_vec = torch.zeros((4, n), dtype=torch.long).pin_memory()
        pool = None
        for b in reversed(sizes):
            meta = AttentionMetadata(list(range(b + 1)), [max_model_len] * b, self.g_tables[:b], self.g_slots[:b],
                                     max_model_len, True, self.g_lens[:b])
            ctx = ForwardContext(meta, self.kv_cache, self.backend)
            with forward_context(ctx):
                self.model(self.g_ids[:b], self.g_pos[:b])  # warm-up: Triton compiles outside the capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.model(self.g_ids[:b], self.g_pos[:b])
            pool = g.pool()
            self.graphs[b] = (g, out)
        self.graph_sizes = sizes
        log.info("captured %d decode graphs (batch 1..%d) in %.1fs", len(sizes), n, time.time() - t0)

    def _graph_forward(self, batch: ScheduledBatch) -> torch.Tensor:
        b = len(batch.requests)
        g_size = next(s for s in self.graph_sizes if s >= b)
        bs = self.block_size
        tables = self._h_tables.numpy()
        vec = self._h_vec.numpy()
        tables[:g_size] = self.scratch_block
        vec[0, :g_size] = 0  # ids
        vec[1, :g_size] = 0  # positions
        vec[2, :g_size] = self.scratch_block * bs  # slots
        vec[3, :g_size] = 1  # seq lens
        for i, req in enumerate(batch.requests):
            p = req.num_computed_tokens
            bids = req.block_ids
            vec[0, i] = req.token_ids[p]
            vec[1, i] = p
            vec[2, i] = bids[p // bs] * bs + p % bs
            vec[3, i] = p + 1
            tables[i, : len(bids)] = bids
        h_vec = self._h_vec[:, :g_size]
        self.g_ids[:g_size].copy_(h_vec[0], non_blocking=True)
        self.g_pos[:g_size].copy_(h_vec[1], non_blocking=True)
        self.g_slots[:g_size].copy_(h_vec[2], non_blocking=True)
        self.g_lens[:g_size].copy_(h_vec[3], non_blocking=True)
        self.g_tables[:g_size].copy_(self._h_tables[:g_size], non_blocking=True)
        graph, out = self.graphs[g_size]
        graph.replay()
        return out[:b]

    def _use_graph(self, batch: ScheduledBatch) -> bool:
        return bool(self.graphs) and len(batch.requests) <= self.graph_sizes[-1] and all(
            n == 1 for n in batch.num_new_tokens)

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch, after_layer=None) -> tuple[torch.Tensor | None, list[Request]]:
        if after_layer is None and self._use_graph(batch):
            hidden = self._graph_forward(batch)
            reqs = [r for r in batch.requests if r.num_computed_tokens + 1 == r.num_tokens]
            if len(reqs) != len(batch.requests):
                keep = [i for i, r in enumerate(batch.requests) if r.num_computed_tokens + 1 == r.num_tokens]
                hidden = hidden[torch.tensor(keep, device=hidden.device)]
            return self.model.compute_logits(hidden), reqs
        ids, pos, meta, sample_idx, sample_reqs = self.prepare(batch)
        with forward_context(ForwardContext(meta, self.kv_cache, self.backend, after_layer)):
            hidden = self.model(ids, pos)
        if not sample_reqs:
            return None, []
        idx = torch.tensor(sample_idx, device=hidden.device)
        return self.model.compute_logits(hidden[idx]), sample_reqs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, after_layer=None) -> tuple[list[Request], SampleResult | None]:
        logits, reqs = self.forward_logits(batch, after_layer)
        if logits is None:
            return [], None
        return reqs, sample(logits, reqs)

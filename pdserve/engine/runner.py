"""Runs a scheduled batch on the device: flattens its tokens, builds attention metadata from block tables,
calls the model once, and samples where a request reached the end of its known tokens."""

from __future__ import annotations

import logging

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
        self.kv_cache = torch.zeros(kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype, device=device)
        self.backend = get_backend(attention_backend, device)
        self._pin = device.type == "cuda"

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

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Request]]:
        ids, pos, meta, sample_idx, sample_reqs = self.prepare(batch)
        with forward_context(ForwardContext(meta, self.kv_cache, self.backend)):
            hidden = self.model(ids, pos)
        if not sample_reqs:
            return None, []
        idx = torch.tensor(sample_idx, device=hidden.device)
        return self.model.compute_logits(hidden[idx]), sample_reqs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], SampleResult | None]:
        logits, reqs = self.forward_logits(batch)
        if logits is None:
            return [], None
        return reqs, sample(logits, reqs)

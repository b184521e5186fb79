"""Turns the last-position logits of a batch into tokens: allowed_token_ids, min_tokens, logit_bias, presence /
frequency / repetition penalties, temperature, top-k, top-p, min-p, per-request seeds, and top-n logprobs of the
model's raw distribution.

Order and definitions follow vLLM's v1 sampler: raw logprobs are taken before anything changes the logits; then the
allowed-token mask, min_tokens (EOS and stop ids banned) and logit_bias; then the penalties (vLLM's apply_penalties:
repetition divides positive and multiplies negative logits of tokens seen in the prompt or the output, frequency
subtracts its value times a token's count in the output, presence subtracts its value once per token present in the
output); then greedy argmax or sampling. Every per-row setting is gathered on the host into a few flat lists and
applied to the whole batch with one scatter/index_put per kind, never one device call per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request

PENALTY_CHUNK_ELEMENTS = 1 << 25  # rows x vocab per count tensor (int32: 128 MiB), bounding the penalties' memory


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (chosen logprob, top-n) per row


def _filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
            min_p: torch.Tensor | None) -> torch.Tensor:
    if top_k is not None:
        k = top_k.clamp(min=1, max=logits.shape[-1])
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(-1) - probs  # mass strictly before each token
        drop = cum > top_p.unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        thresh = probs.max(-1, keepdim=True).values * min_p.unsqueeze(-1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest] int64, padded with `pad` (one host->device copy)."""
    width = max(1, max(len(r) for r in rows))
    flat = [r + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per-row occurrence counts [rows, vocab] of padded token ids (the pad id `vocab` lands in a dropped column)."""
    counts = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.int32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """vLLM's presence / frequency / repetition penalties, in place, on the rows whose requests set any."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    vocab = logits.shape[-1]
    step = max(1, PENALTY_CHUNK_ELEMENTS // (vocab + 1))
    dev = logits.device
    for start in range(0, len(rows), step):
        part = rows[start : start + step]
        ps = [reqs[i].params for i in part]
        idx = torch.tensor(part, dtype=torch.long, device=dev)
        sub = logits.index_select(0, idx)
        out_counts = _counts(_padded([reqs[i].output_token_ids for i in part], vocab, dev), vocab)
        rep = [p.repetition_penalty for p in ps]
        if any(r != 1.0 for r in rep):
            prompt_seen = _counts(_padded([reqs[i].prompt_token_ids for i in part], vocab, dev), vocab) > 0
            seen = prompt_seen | (out_counts > 0)
            pen = torch.tensor(rep, dtype=sub.dtype, device=dev).unsqueeze(1)
            penalized = torch.where(sub > 0, sub / pen, sub * pen)
            sub = torch.where(seen, penalized, sub)
        freq = torch.tensor([p.frequency_penalty for p in ps], dtype=sub.dtype, device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in ps], dtype=sub.dtype, device=dev).unsqueeze(1)
        sub = sub - freq * out_counts.to(sub.dtype) - pres * (out_counts > 0).to(sub.dtype)
        logits.index_copy_(0, idx, sub)


def apply_token_rules(logits: torch.Tensor, reqs: list[Request]) -> None:
    """allowed_token_ids, min_tokens and logit_bias, in place: each gathered into flat index lists, applied once."""
    vocab = logits.shape[-1]
    dev = logits.device
    allow_rows: list[int] = []  # rows restricted to a list
    allow_at: list[int] = []  # (position in allow_rows, token) pairs that stay allowed
    allow_toks: list[int] = []
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    bias_rows: list[int] = []
    bias_toks: list[int] = []
    bias_vals: list[float] = []
    for i, r in enumerate(reqs):
        p = r.params
        if p.allowed_token_ids is not None:
            toks = [t for t in p.allowed_token_ids if 0 <= t < vocab]
            allow_at.extend([len(allow_rows)] * len(toks))
            allow_toks.extend(toks)
            allow_rows.append(i)
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            toks = [t for t in banned if 0 <= t < vocab]
            ban_rows.extend([i] * len(toks))
            ban_toks.extend(toks)
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if 0 <= t < vocab:
                    bias_rows.append(i)
                    bias_toks.append(t)
                    bias_vals.append(b)
    if allow_rows:
        rows = torch.tensor(allow_rows, dtype=torch.long, device=dev)
        banned_mask = torch.ones((len(allow_rows), vocab), dtype=torch.bool, device=dev)
        if allow_toks:
            banned_mask.index_put_((torch.tensor(allow_at, device=dev), torch.tensor(allow_toks, device=dev)),
                                   torch.tensor(False, device=dev))
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(banned_mask, float("-inf")))
    if ban_rows:
        logits.index_put_((torch.tensor(ban_rows, device=dev), torch.tensor(ban_toks, device=dev)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_toks, device=dev)),
                          torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)


def _needs_processing(r: Request) -> bool:
    p = r.params
    return (p.allowed_token_ids is not None or bool(p.logit_bias) or p.has_penalties
            or bool(p.min_tokens and r.num_output_tokens < p.min_tokens))


def process_logits(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Everything that changes the logits before sampling, as float32; the input tensor (which may be a CUDA graph's
    output buffer) is copied before anything is written, and only when some request needs it."""
    logits = logits.float()
    if not any(_needs_processing(r) for r in reqs):
        return logits
    logits = logits.clone()
    apply_token_rules(logits, reqs)
    apply_penalties(logits, reqs)
    return logits


def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
    n = len(reqs)
    want_lp = [r.params.logprobs for r in reqs]
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(w is not None for w in want_lp) else None
    logits = process_logits(logits, reqs)
    vocab = logits.shape[-1]

    greedy = [r.params.greedy for r in reqs]
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if any(greedy):
        gi = [i for i in range(n) if greedy[i]]
        out[gi] = logits[gi].argmax(-1)
    ri = [i for i in range(n) if not greedy[i]]
    if ri:
        sub = logits[ri]
        ps = [reqs[i].params for i in ri]
        temp = torch.tensor([p.temperature for p in ps], device=logits.device, dtype=torch.float32)
        sub = sub / temp.unsqueeze(-1)
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], device=logits.device) \
            if any(p.top_k > 0 for p in ps) else None
        top_p = torch.tensor([p.top_p for p in ps], device=logits.device) if any(p.top_p < 1 for p in ps) else None
        min_p = torch.tensor([p.min_p for p in ps], device=logits.device) if any(p.min_p > 0 for p in ps) else None
        sub = _filter(sub, top_k, top_p, min_p)
        probs = torch.softmax(sub, dim=-1)
        q = torch.empty_like(probs)
        for j, i in enumerate(ri):
            g = reqs[i].generator
            if g is not None:
                q[j].exponential_(generator=g)
            else:
                q[j].exponential_()
        out[ri] = (probs / q).argmax(-1)  # exponential race: one draw from `probs`
    tokens = out.tolist()

    lps: list = [None] * n
    if raw_logprobs is not None:
        for i, w in enumerate(want_lp):
            if w is None:
                continue
            chosen = float(raw_logprobs[i, tokens[i]])
            top: list[tuple[int, float]] = []
            if w > 0:
                v, ix = torch.topk(raw_logprobs[i], w)
                top = list(zip(ix.tolist(), v.tolist()))
            lps[i] = (chosen, top)
    return SampleResult(tokens, lps)

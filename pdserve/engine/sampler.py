"""Turns the last-position logits of a batch into tokens: temperature, top-k, top-p, min-p, per-request seeds,
min_tokens, and top-n logprobs of the model's raw distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request


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


def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
    logits = logits.float()
    n = len(reqs)
    want_lp = [r.params.logprobs for r in reqs]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(w is not None for w in want_lp) else None

    # min_tokens: hide EOS and stop ids until enough tokens exist
    for i, r in enumerate(reqs):
        p = r.params
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")

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
        top_k = torch.tensor([p.top_k if p.top_k > 0 else sub.shape[-1] for p in ps], device=logits.device) \
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

"""Turns the last-position logits of a batch into tokens: allowed_token_ids, min_tokens, logit_bias, presence /
frequency / repetition penalties, temperature, top-k, top-p, min-p, per-request seeds, and top-n logprobs of the
model's raw distribution.

Order and definitions follow vLLM's v1 sampler: raw logprobs are taken before anything changes the logits; then the
allowed-token mask, min_tokens (EOS and stop ids banned) and logit_bias; then the penalties (vLLM's apply_penalties:
repetition divides positive and multiplies negative logits of tokens seen in the prompt or the output, frequency
subtracts its value times a token's count in the output, presence subtracts its value once per token present in the
output); then greedy argmax or sampling. Every per-row setting is gathered on the host into a few flat lists and
applied to the whole batch with one scatter/index_put per kind, never one device call per row.

On CUDA a batch of greedy rows and plain temperature sampling (no top-k/top-p/min-p, seed, logprobs or logit
changes: a request that leaves those out, at the OpenAI default temperature of 1) is sampled by one kernel over the
16-bit logits (pdserve.ops.sampling: the Gumbel-max trick, the same distribution as the exponential race here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.ops.dispatch import use_fused
from pdserve.ops.sampling import sample_tokens

PENALTY_CHUNK_ELEMENTS = 1 << 25  # rows x vocab per count tensor (int32: 128 MiB), bounding the penalties' memory
SAMPLER_CHUNK_ELEMENTS = 1 << 23  # rows x vocab sampled at a time (float32: 32 MiB a temporary; 55 rows of Qwen3's
# 151,936 tokens): bounds the sampler's share of a step's peak memory, which the KV pool leaves free


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (chosen logprob, top-n) per row


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device: on CUDA through pinned memory and a
    non-blocking copy (`torch.tensor(..., device="cuda")` would synchronize the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
            min_p: torch.Tensor | None, k_max: int = 0) -> torch.Tensor:
    if top_k is not None:
        k = top_k.clamp(min=1, max=logits.shape[-1])
        kth = torch.topk(logits, k_max, dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
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
    return to_device(flat, torch.long, device)


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
        idx = to_device(part, torch.long, dev)
        sub = logits.index_select(0, idx)
        out_counts = _counts(_padded([reqs[i].output_token_ids for i in part], vocab, dev), vocab)
        rep = [p.repetition_penalty for p in ps]
        if any(r != 1.0 for r in rep):
            prompt_seen = _counts(_padded([reqs[i].prompt_token_ids for i in part], vocab, dev), vocab) > 0
            seen = prompt_seen | (out_counts > 0)
            pen = to_device(rep, sub.dtype, dev).unsqueeze(1)
            penalized = torch.where(sub > 0, sub / pen, sub * pen)
            sub = torch.where(seen, penalized, sub)
        freq = to_device([p.frequency_penalty for p in ps], sub.dtype, dev).unsqueeze(1)
        pres = to_device([p.presence_penalty for p in ps], sub.dtype, dev).unsqueeze(1)
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
        rows = to_device(allow_rows, torch.long, dev)
        banned_mask = torch.ones((len(allow_rows), vocab), dtype=torch.bool, device=dev)
        if allow_toks:
            banned_mask.index_put_((to_device(allow_at, torch.long, dev), to_device(allow_toks, torch.long, dev)),
                                   to_device([False], torch.bool, dev))
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(banned_mask, float("-inf")))
    if ban_rows:
        logits.index_put_((to_device(ban_rows, torch.long, dev), to_device(ban_toks, torch.long, dev)),
                          to_device([float("-inf")], logits.dtype, dev))
    if bias_rows:
        logits.index_put_((to_device(bias_rows, torch.long, dev), to_device(bias_toks, torch.long, dev)),
                          to_device(bias_vals, logits.dtype, dev), accumulate=True)


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


@dataclass
class PendingSample:
    """A step's sampled tokens (and logprobs) on their way to the host: the device tensors stay referenced, the
    copies into pinned memory were started without waiting, and `event` marks their end (None on CPU)."""

    tokens: torch.Tensor  # [rows] int64 on the device: what the next step's placeholder rows read
    host_tokens: torch.Tensor  # [rows] int64 on the host (pinned), valid once `event` completed
    want_logprobs: list[int | None]  # per row: top-n wanted (0: the chosen one only), None: no logprobs
    host_chosen: torch.Tensor | None  # [rows] float32: logprob of the sampled token
    host_top_values: torch.Tensor | None  # [rows, max n] float32
    host_top_ids: torch.Tensor | None  # [rows, max n] int64
    event: torch.cuda.Event | None

    def result(self) -> SampleResult:
        """Wait for the copies (the one host sync of a step) and read them."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host_tokens.tolist()
        lps: list = [None] * len(tokens)
        if self.host_chosen is not None:
            chosen = self.host_chosen.tolist()
            top_v = self.host_top_values.tolist() if self.host_top_values is not None else None
            top_i = self.host_top_ids.tolist() if self.host_top_ids is not None else None
            for i, w in enumerate(self.want_logprobs):
                if w is None:
                    continue
                top = list(zip(top_i[i][:w], top_v[i][:w])) if w > 0 else []
                lps[i] = (chosen[i], top)
        return SampleResult(tokens, lps)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """Start a copy of `x` into pinned host memory (CUDA; returns the destination) or return `x` (CPU)."""
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    return out


def _draw(logits: torch.Tensor, reqs: list[Request], rows: list[int], vocab: int) -> torch.Tensor:
    """One token per row of `logits` (the requests `reqs[rows]`): temperature, top-k/p, min-p, then the
    exponential race, each seeded row drawing from its own generator (one draw of the vocabulary per token)."""
    dev = logits.device
    ps = [reqs[i].params for i in rows]
    temp = to_device([p.temperature for p in ps], torch.float32, dev)
    sub = logits / temp.unsqueeze(-1)
    top_k = k_max = None
    if any(p.top_k > 0 for p in ps):
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps]
        top_k, k_max = to_device(ks, torch.long, dev), max(ks)
    top_p = to_device([p.top_p for p in ps], torch.float32, dev) if any(p.top_p < 1 for p in ps) else None
    min_p = to_device([p.min_p for p in ps], torch.float32, dev) if any(p.min_p > 0 for p in ps) else None
    sub = _filter(sub, top_k, top_p, min_p, k_max or 0)
    probs = torch.softmax(sub, dim=-1)
    q = torch.empty_like(probs)
    gens = [reqs[i].generator for i in rows]
    if all(g is None for g in gens):
        q.exponential_()
    else:
        for j, g in enumerate(gens):
            if g is not None:
                q[j].exponential_(generator=g)
            else:
                q[j].exponential_()
    return (probs / q).argmax(-1)  # exponential race: one draw from `probs`


def _sample_rows(logits: torch.Tensor, reqs: list[Request], w_max: int | None):
    """(tokens, chosen logprobs, top-n values, top-n ids) of the rows of `logits` (device tensors, nothing waited
    for); the logprob tensors are None when `w_max` is None (no row of the batch wants logprobs), the top-n ones
    when it is 0."""
    n = len(reqs)
    dev = logits.device
    if w_max is None and all(_is_light(r) for r in reqs):
        # greedy with nothing that changes the logits: the argmax of the logits as they are. Widening to float32 is
        # exact and keeps their order (ties resolve to the first index either way), so the ids are the same without
        # the [rows, vocab] float copy (at 256 rows of a 152k vocabulary on an H200: ~0.15 ms of a ~17 ms step)
        return logits.argmax(-1), None, None, None
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if w_max is not None else None
    logits = process_logits(logits, reqs)
    vocab = logits.shape[-1]
    ri = [i for i in range(n) if not reqs[i].params.greedy]
    if not ri:
        out = logits.argmax(-1)
    elif len(ri) == n:
        out = _draw(logits, reqs, ri, vocab)
    else:
        idx = to_device(ri, torch.long, dev)
        out = logits.argmax(-1).index_copy_(0, idx, _draw(logits.index_select(0, idx), reqs, ri, vocab))
    del logits
    chosen = top_v = top_i = None
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, out.unsqueeze(1)).squeeze(1)
        if w_max > 0:
            top_v, top_i = torch.topk(raw_logprobs, w_max, dim=-1)
    return out, chosen, top_v, top_i


def sampler_chunk_rows(num_rows: int, vocab: int) -> int:
    """Rows sampled at a time: all of them, or as many as keep a [rows, vocab] temporary within
    SAMPLER_CHUNK_ELEMENTS."""
    return max(1, min(num_rows, SAMPLER_CHUNK_ELEMENTS // max(1, vocab)))


def _is_light(r: Request) -> bool:
    """Greedy, no logprobs, nothing that changes the logits: an argmax, whose memory is one float copy."""
    return r.params.greedy and r.params.logprobs is None and not _needs_processing(r)


def _one_pass(r: Request) -> bool:
    """What pdserve.ops.sampling's one-pass kernel samples: greedy, or plain temperature sampling (no top-k, top-p
    or min-p, no seed of its own); no logprobs and nothing that changes the logits."""
    p = r.params
    if p.logprobs is not None or _needs_processing(r):
        return False
    return p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and r.generator is None)


def _step_seed() -> int:
    """The one-pass kernel's random stream for a step, from torch's global generator (torch.manual_seed makes runs
    repeat); 31 bits, so the kernel's seed argument keeps one type (no recompile)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def sample_async(logits: torch.Tensor, reqs: list[Request]) -> PendingSample:
    """Sample every row of `logits` on its device without waiting for it: no `.tolist()`, `.item()` or blocking
    copy here (host lists reach the device through pinned memory). The tokens stay on the device for the next
    step; their host copies are read by `PendingSample.result`.

    A batch with rows that sample, take logprobs or change their logits goes through in chunks of
    `sampler_chunk_rows` rows: the sorts and float copies of top-p/top-k, penalties and logprobs then need memory
    for one chunk, not the batch (that peak is what the KV pool must leave free: pdserve.engine.memory_profile).
    Seeded rows draw from their own generators either way; greedy rows give the same tokens."""
    n = len(reqs)
    dev = logits.device
    want_lp = [r.params.logprobs for r in reqs]
    w_max = max(w or 0 for w in want_lp) if any(w is not None for w in want_lp) else None
    light = all(_is_light(r) for r in reqs)
    if not light and use_fused(logits) and all(_one_pass(r) for r in reqs):
        # greedy rows and plain temperature sampling: one kernel over the 16-bit logits (pdserve.ops.sampling) in
        # place of the float copies, softmax and exponential tensor of the torch path
        inv_temp = to_device([0.0 if r.params.greedy else 1.0 / r.params.temperature for r in reqs], torch.float32,
                             dev)
        parts = [(sample_tokens(logits, inv_temp, _step_seed()), None, None, None)]
    else:
        step = n if light else sampler_chunk_rows(n, logits.shape[-1])
        parts = [_sample_rows(logits[s : s + step], reqs[s : s + step], w_max)
                 for s in range(0, n, step)]
    if len(parts) == 1:
        out, chosen, top_v, top_i = parts[0]
    else:
        out, chosen, top_v, top_i = (torch.cat([p[k] for p in parts]) if parts[0][k] is not None else None
                                     for k in range(4))
    host = [_to_host(t) if t is not None else None for t in (out, chosen, top_v, top_i)]
    event = None
    if dev.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    return PendingSample(out, host[0], want_lp, host[1], host[2], host[3], event)


def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
    """Sample and wait for the tokens (synchronous use)."""
    return sample_async(logits, reqs).result()

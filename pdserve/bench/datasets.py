"""Request datasets: random prompts of exact token lengths, ShareGPT conversations, and prompt files.

Each dataset yields `BenchRequest`s whose prompt length is counted with the target's tokenizer, so the
benchmark's input token totals match what the server sees (minus the special tokens it adds, e.g. BOS).
The multi-round chat dataset lives in multiround.py because its prompts are built at send time.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.tokenizer import BenchTokenizer


@dataclass
class BenchRequest:
    """One request to send: a completion prompt or chat messages, and how many tokens to ask for."""

    prompt: str | None
    prompt_len: int  # tokens under the benchmark tokenizer, without special tokens; -1 when unknown
    output_len: int
    messages: list[dict] | None = None

    async def materialize(self) -> BenchRequest:
        """The request to send now (multi-round requests build theirs from the conversation so far)."""
        return self

    def complete(self, generated_text: str, success: bool) -> None:
        """Called when the request finished; plain requests keep no state."""


def exact_length_text(
    tok: BenchTokenizer, target_len: int, rng: random.Random, pool, prefix_ids: list[int] | None = None
) -> tuple[str, list[int]]:
    """Text that re-encodes to exactly `target_len` tokens: sample ids, decode, re-encode, fix up (as vLLM does).

    Decoding arbitrary ids and encoding the text again can merge or split tokens; truncating or topping up the
    re-encoded ids converges in a few rounds for BPE vocabularies and at once for word-level ones.
    """
    if target_len < 0:
        raise ValueError(f"prompt length must be non-negative, got {target_len}")
    ids = list(prefix_ids or [])[:target_len]
    ids += rng.choices(pool, k=target_len - len(ids))
    for _ in range(64):
        text = tok.decode(ids)
        re_ids = tok.encode(text)
        if len(re_ids) == target_len:
            return text, re_ids
        if len(re_ids) > target_len:
            ids = re_ids[:target_len]
        else:
            ids = re_ids + rng.choices(pool, k=target_len - len(re_ids))
    raise ValueError(
        f"could not build a prompt of exactly {target_len} tokens with tokenizer {tok.source} "
        "(its decode/encode does not round-trip); use another dataset or tokenizer"
    )


def length_bounds(mean: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """[floor(mean*(1-r)), ceil(mean*(1+r))], as vLLM's --random-range-ratio (both ends at least `minimum`)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    return max(math.floor(mean * (1 - range_ratio)), minimum), max(math.ceil(mean * (1 + range_ratio)), minimum)


def random_dataset(
    tok: BenchTokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    """vLLM 0.22's random dataset: `prefix_len` shared random tokens, then a run of consecutive vocabulary ids.

    As vLLM: `input_len` counts the special tokens the tokenizer adds (BOS), so the server sees `input_len`
    prompt tokens; lengths are integers uniform in the --random-range-ratio bounds, drawn with
    numpy.random.default_rng(seed) in vLLM's order (input lengths, output lengths, offsets, then the prefix);
    request i's own tokens are ids offset_i + i, offset_i + i + 1, ... of the non-special vocabulary. The text
    is then fixed up to re-encode to exactly its length (vLLM truncates; this also tops up).
    """
    num_special = tok.num_special_tokens_added
    real_in = max(0, int(input_len) - num_special)
    in_lo, in_hi = length_bounds(real_in, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio, minimum=1)
    if prefix_len + in_lo < 1:
        raise ValueError(
            f"--random-input-len {input_len} is too small: with {num_special} special tokens and range ratio "
            f"{range_ratio} a prompt could have {prefix_len + in_lo} tokens; it needs at least 1"
        )
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    offsets = rng.integers(0, tok.vocab_size, size=num_prompts)
    pool = list(tok.sampleable_ids())
    prefix_ids = [pool[int(i)] for i in rng.integers(0, len(pool), size=prefix_len)] if prefix_len > 0 else []
    fixups = random.Random(seed)
    out = []
    for i, (n_in, n_out, off) in enumerate(zip(in_lens.tolist(), out_lens.tolist(), offsets.tolist())):
        inner = [pool[(off + i + k) % len(pool)] for k in range(n_in)]
        text, ids = exact_length_text(tok, prefix_len + n_in, fixups, pool, prefix_ids=prefix_ids + inner)
        out.append(BenchRequest(prompt=text, prompt_len=len(ids), output_len=n_out))
    return out


def _cycle(items: list[BenchRequest], n: int, rng: random.Random) -> list[BenchRequest]:
    if not items:
        raise ValueError("the dataset has no usable entries")
    rng.shuffle(items)
    return [items[i % len(items)] for i in range(n)]


def sharegpt_dataset(
    path: str, tok: BenchTokenizer | None, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's token count as output length (vLLM's filters applied)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    if tok is None and output_len is None:
        raise ValueError("the sharegpt dataset needs --tokenizer (or --sharegpt-output-len) to size outputs")
    items = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not conv or len(conv) < 2:
            continue
        prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        p_len = tok.count(prompt) if tok else -1
        o_len = output_len if output_len is not None else tok.count(reply)
        if output_len is None and (p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048):
            continue  # vLLM's default filter: drop too-short and too-long conversations
        items.append(BenchRequest(prompt=prompt, prompt_len=p_len, output_len=o_len))
    return _cycle(items, num_prompts, random.Random(seed))


def file_dataset(
    path: str, tok: BenchTokenizer | None, num_prompts: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """A JSONL file of {"prompt": ...} or {"messages": [...]} (optional "output_len"/"max_tokens"), or plain lines."""
    items = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = line
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with 'prompt' or 'messages', or a text line")
        n_out = int(obj.get("output_len", obj.get("max_tokens", output_len)))
        if "messages" in obj:
            msgs = obj["messages"]
            p_len = sum(tok.count(str(m.get("content", ""))) for m in msgs) if tok else -1
            items.append(BenchRequest(prompt=None, messages=msgs, prompt_len=p_len, output_len=n_out))
        else:
            prompt = str(obj["prompt"])
            items.append(BenchRequest(prompt=prompt, prompt_len=tok.count(prompt) if tok else -1, output_len=n_out))
    return _cycle(items, num_prompts, random.Random(seed))

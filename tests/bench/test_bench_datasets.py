"""Datasets: prompts of exactly the requested token lengths under the target's tokenizer."""

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.datasets import exact_length_text, file_dataset, random_dataset, sharegpt_dataset
from pdserve.bench.multiround import multi_round_dataset
from pdserve.bench.tokenizer import load_tokenizer


def test_random_exact_lengths_word_level(word_tokenizer_dir):
    tok = load_tokenizer(str(word_tokenizer_dir))
    reqs = random_dataset(tok, num_prompts=20, input_len=100, output_len=7, range_ratio=0.5, prefix_len=16, seed=3)
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len
        assert 16 + 50 <= r.prompt_len <= 16 + 150 and 3 <= r.output_len <= 11  # floor/ceil bounds as vLLM
    prefixes = {tuple(tok.encode(r.prompt)[:16]) for r in reqs}
    assert len(prefixes) == 1  # the shared prefix
    assert len({r.prompt for r in reqs}) == 20
    fixed = random_dataset(tok, num_prompts=5, input_len=33, output_len=7, seed=1)
    assert [r.prompt_len for r in fixed] == [33] * 5 and [r.output_len for r in fixed] == [7] * 5


def test_random_lengths_and_tokens_follow_vllms_draws(word_tokenizer_dir):
    """Lengths come from numpy.random.default_rng(seed) in vLLM's order (input lengths, output lengths, offsets),
    and request i's tokens are the vocabulary ids offset_i + i, offset_i + i + 1, ... (word-level: exact)."""
    tok = load_tokenizer(str(word_tokenizer_dir))
    n, seed = 12, 5
    reqs = random_dataset(tok, num_prompts=n, input_len=40, output_len=20, range_ratio=0.25, seed=seed)
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(30, 50 + 1, size=n)
    out_lens = rng.integers(15, 25 + 1, size=n)
    offsets = rng.integers(0, tok.vocab_size, size=n)
    assert [r.prompt_len for r in reqs] == in_lens.tolist() and [r.output_len for r in reqs] == out_lens.tolist()
    for i, r in enumerate(reqs):
        assert tok.encode(r.prompt) == [(offsets[i] + i + k) % tok.vocab_size for k in range(in_lens[i])]


def test_random_exact_lengths_default_model_bpe_tokenizer():
    """Gemma's BPE merges decoded ids on re-encoding; the fix-up still lands exactly on each length."""
    tok = load_tokenizer("gemma-3-270m")
    rng = random.Random(0)
    pool = tok.sampleable_ids()
    for n in (1, 2, 17, 128, 1000):
        text, ids = exact_length_text(tok, n, rng, pool)
        assert len(tok.encode(text)) == n == len(ids)
    reqs = random_dataset(tok, num_prompts=8, input_len=64, output_len=4, prefix_len=32, seed=0)
    assert tok.num_special_tokens_added == 1  # <bos>
    # as vLLM: --random-input-len counts the <bos> the server adds, so the text itself has one token fewer
    assert all(len(tok.encode(r.prompt)) == r.prompt_len == 32 + 63 for r in reqs)


def test_bad_lengths_are_rejected(word_tokenizer_dir):
    tok = load_tokenizer(str(word_tokenizer_dir))
    with pytest.raises(ValueError):
        random_dataset(tok, 2, 0, 4)
    with pytest.raises(ValueError):
        random_dataset(tok, 2, 8, 4, range_ratio=1.0)
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer("/nonexistent/tokenizer")


def test_multi_round_history_grows_with_real_answers(word_tokenizer_dir):
    tok = load_tokenizer(str(word_tokenizer_dir))
    reqs = multi_round_dataset(tok, num_users=3, num_rounds=3, system_len=40, history_len=10, question_len=5,
                               output_len=4, chat=True, seed=0)
    assert len(reqs) == 9 and [r.round for r in reqs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]

    async def go():
        first = await reqs[0].materialize()
        reqs[0].complete("t7 t8 t9", success=True)
        second = await asyncio.wait_for(reqs[3].materialize(), 1.0)  # same user, next round
        blocked = asyncio.ensure_future(reqs[4].materialize())  # user 1 round 1 waits for its round 0
        await asyncio.sleep(0.05)
        assert not blocked.done()
        reqs[1].complete("t1", success=True)
        await asyncio.wait_for(blocked, 1.0)
        return first, second

    first, second = asyncio.run(go())
    assert first.messages[0]["role"] == "system" and len(tok.encode(first.messages[0]["content"])) == 40
    assert second.messages[:2] == first.messages[:2]
    assert second.messages[2] == {"role": "assistant", "content": "t7 t8 t9"}
    assert second.prompt_len > first.prompt_len
    systems = {r.conversation.system for r in reqs}
    assert len(systems) == 1  # shared across users


def test_sharegpt_and_file_datasets(tmp_path, word_tokenizer_dir):
    tok = load_tokenizer(str(word_tokenizer_dir))
    conv = [{"conversations": [{"from": "human", "value": "t1 t2 t3 t4 t5"}, {"from": "gpt", "value": "t6 t7 t8 t9"}]},
            {"conversations": [{"from": "human", "value": "t1"}, {"from": "gpt", "value": "t2"}]}]  # too short
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(conv))
    reqs = sharegpt_dataset(str(p), tok, num_prompts=3)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(5, 4)] * 3
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "t1 t2", "output_len": 3}\nplain t3 text\n{"messages": [{"role": "user", "content": "t4"}]}\n')
    reqs = file_dataset(str(f), tok, num_prompts=3, output_len=9)
    assert sorted((r.prompt_len, r.output_len, r.messages is None) for r in reqs) == [
        (1, 9, False), (2, 3, True), (3, 9, True)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        file_dataset(str(bad), tok, 1, 4)


def test_shipped_shape_names_get_the_servers_word_level_tokenizer():
    """`pdserve serve --model qwen3-0.6b --load-format dummy` serves "qwen3-0.6b": the bench finds its tokenizer."""
    cfg = json.loads((Path(__file__).resolve().parents[2] / "pdserve/model/configs/qwen3-0.6b.json").read_text())
    tok = load_tokenizer("qwen3-0.6b")
    assert tok.vocab_size == cfg.get("text_config", cfg)["vocab_size"]
    reqs = random_dataset(tok, num_prompts=3, input_len=1024, output_len=4, seed=0)
    assert all(len(tok.encode(r.prompt)) == 1024 for r in reqs)
    assert tok.decode([5, tok.vocab_size - 1]) == f"t5 t{tok.vocab_size - 1}"

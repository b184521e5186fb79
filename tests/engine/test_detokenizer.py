"""Streaming text: incremental detokenization (UTF-8 safe, spaces kept, small windows) and stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.stop_checker import StopChecker
from pdserve.engine.tokenizer import Tokenizer
from pdserve.model.default_model import resolve_model_path

STREAM_TEXTS = [
    "Hello world",
    " Héllo wörld, naïve café. Ünïcödé àçcénts",
    "你好，世界！日本語のテキスト、한국어 텍스트",
    "emoji 🎉🎉 👩‍👩‍👧 flags 🇫🇷🇯🇵 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
    "  two  spaces\n\nnewlines\ttab  ",
]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.load(resolve_model_path("default"))


def _byte_level_bpe(tmp: Path) -> Tokenizer:
    """A GPT-2-style byte-level BPE small enough that most non-ASCII characters span several tokens."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = FastTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 50, trainer)
    tmp.mkdir(parents=True, exist_ok=True)
    tk.save(str(tmp / "tokenizer.json"))
    return Tokenizer.load(str(tmp))


def _metaspace_strip(tmp: Path) -> Tokenizer:
    """A Llama-2-style SentencePiece layout: "▁" word prefix, byte fallback, a decoder that strips the first space."""
    import json

    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = FastTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator(["hello world, the quick brown fox"] * 50, trainers.BpeTrainer(vocab_size=200))
    spec = json.loads(tk.to_str())
    # Byte tokens live in the model's vocabulary (not as added specials), as in SentencePiece models.
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    vocab.setdefault("<unk>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>")
    tk = FastTokenizer.from_str(json.dumps(spec))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tmp.mkdir(parents=True, exist_ok=True)
    tk.save(str(tmp / "tokenizer.json"))
    return Tokenizer.load(str(tmp))


@pytest.fixture(scope="module")
def tokenizers_under_test(gemma, tmp_path_factory):
    base = tmp_path_factory.mktemp("detok")
    return {"gemma": gemma, "byte_level": _byte_level_bpe(base / "bl"), "metaspace": _metaspace_strip(base / "ms")}


def _stream(tok, prompt_ids, out_ids, chunk=1, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [d.push(out_ids[i:i + chunk]) for i in range(0, len(out_ids), chunk)]
    return d, deltas


@pytest.mark.parametrize("name", ["gemma", "byte_level", "metaspace"])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_equals_full_decode_at_every_complete_point(tokenizers_under_test, name, text):
    tok = tokenizers_under_test[name]
    prompt = tok.encode("Say:")
    out = tok.encode(text, add_special_tokens=False)
    prompt_text = tok.decode(prompt)
    d = IncrementalDetokenizer(tok, prompt)
    streamed = ""
    held_points = 0
    for k, t in enumerate(out, start=1):
        delta = d.push([t])
        assert REPLACEMENT not in delta, f"{name}: delta {delta!r} has a broken character"
        streamed += delta
        full = tok.decode(prompt + out[:k])
        if not full.endswith(REPLACEMENT):
            assert streamed == full[len(prompt_text):], f"{name}: after {k} tokens"
        else:
            held_points += 1
    streamed += d.flush()
    assert streamed == d.text == tok.decode(prompt + out)[len(prompt_text):]
    if name == "byte_level" and any(ord(c) > 127 for c in text):
        assert held_points > 0  # the test really exercised split characters


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_pushes(gemma, chunk):
    text = STREAM_TEXTS[3]
    prompt = gemma.encode("Say:")
    out = gemma.encode(text, add_special_tokens=False)
    d, deltas = _stream(gemma, prompt, out, chunk)
    assert "".join(deltas) + d.flush() == text


def test_spaces_kept(gemma, tokenizers_under_test):
    prompt = gemma.encode("Say:")
    out = gemma.encode("Hello world", add_special_tokens=False)
    _, deltas = _stream(gemma, prompt, out)
    assert deltas == ["Hello", " world"]
    # Llama-2-style decoders strip a leading space from what they decode: the stream must not lose it.
    ms = tokenizers_under_test["metaspace"]
    prompt = ms.encode("hello")
    out = ms.encode("hello world hello")[len(prompt):]  # "▁wor", ...: the tokens a model would generate next
    assert ms.convert_ids_to_tokens(out)[0].startswith("▁") and ms.decode(out[:1]) == ms.decode(out[:1]).lstrip()
    d, deltas = _stream(ms, prompt, out)
    assert "".join(deltas) == ms.decode(prompt + out)[len(ms.decode(prompt)):]
    assert "".join(deltas).startswith(" ")


def test_empty_prompt(gemma):
    out = gemma.encode("Hello world 🎉", add_special_tokens=False)
    d, deltas = _stream(gemma, [], out)
    assert "".join(deltas) + d.flush() == "Hello world 🎉"


def test_incomplete_character_is_held_until_flush(gemma):
    # A 4-byte character outside the vocabulary is spelled with byte-fallback tokens.
    out = gemma.encode("𝔘", add_special_tokens=False)
    assert len(out) > 1
    d = IncrementalDetokenizer(gemma, gemma.encode("x"))
    assert d.push(out[:1]) == ""
    tail = d.flush()
    assert tail == gemma.decode(out[:1]) and tail.endswith(REPLACEMENT)
    assert d.text == tail


def test_special_tokens_skipped_or_kept(gemma):
    prompt = gemma.encode_chat([{"role": "user", "content": "Hi"}])
    out = gemma.encode("Hello!<end_of_turn>", add_special_tokens=False)
    d, deltas = _stream(gemma, prompt, out)
    assert "".join(deltas) + d.flush() == "Hello!"
    d, deltas = _stream(gemma, prompt, out, skip_special_tokens=False)
    assert "".join(deltas) + d.flush() == "Hello!<end_of_turn>"


def test_decode_windows_stay_small(gemma):
    """O(1) per token: each push decodes a few tokens, not the whole output."""
    widths: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            widths.append(len(ids))
            return gemma.decode(ids, skip_special_tokens=skip_special_tokens)

    out = gemma.encode(" ".join(STREAM_TEXTS) * 40, add_special_tokens=False)
    d, deltas = _stream(Spy(), gemma.encode("Say:"), out)
    assert "".join(deltas) + d.flush() == gemma.decode(out)
    longest_char_tokens = max(len(gemma.encode(c, add_special_tokens=False)) for c in "".join(STREAM_TEXTS))
    assert len(out) > 20 * max(widths)
    # Window = context of the previous emission + the tokens of the character being completed (+ the prompt tail).
    assert max(widths) <= 2 * longest_char_tokens + 5


# ------------------------------------------------------------------ stop strings
def _feed_all(checker: StopChecker, deltas: list[str]) -> tuple[str, str | None]:
    emitted = ""
    for delta in deltas:
        out, matched = checker.feed(delta)
        emitted += out
        if matched is not None:
            return emitted, matched
    return emitted + checker.flush(), None


def test_stop_split_across_deltas():
    c = StopChecker(["<|end|>"], include_stop_str_in_output=False)
    outs = [c.feed(x) for x in ["Hello <|", "en", "d|> more"]]
    assert outs == [("Hello ", None), ("", None), ("", "<|end|>")]


def test_stop_included_in_output():
    c = StopChecker(["<|end|>"], include_stop_str_in_output=True)
    assert _feed_all(c, ["Hello <|", "end|", "> more"]) == ("Hello <|end|>", "<|end|>")


def test_false_start_is_released():
    c = StopChecker(["abc"], False)
    assert c.feed("xab") == ("x", None)
    assert c.held == "ab"
    assert c.feed("x") == ("abx", None)
    assert c.feed("ab") == ("", None)
    assert c.flush() == "ab"


def test_first_complete_stop_wins_and_longest_at_a_tie():
    assert _feed_all(StopChecker(["world", "lo w"], False), ["hello world"]) == ("hel", "lo w")
    # "ab" is complete before "abc" can be: the same answer whether or not "c" arrives in the same delta.
    assert _feed_all(StopChecker(["abc", "ab"], True), ["xab", "cd"]) == ("xab", "ab")
    assert _feed_all(StopChecker(["abc", "ab"], True), ["xabcd"]) == ("xab", "ab")
    assert _feed_all(StopChecker(["b", "ab"], False), ["xa", "bc"]) == ("x", "ab")


def test_no_stops_passes_through_and_feed_after_match_drops():
    c = StopChecker([], False)
    assert c.feed("anything") == ("anything", None)
    c = StopChecker(["\n\n"], False)
    assert c.feed("para one\n\npara two") == ("para one", "\n\n")
    assert c.feed("more") == ("", "\n\n")


def test_bad_stop_strings():
    with pytest.raises(ValueError):
        StopChecker([""], False)


@pytest.mark.parametrize("seed", range(200))
def test_stop_random_splits_match_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    include = rng.random() < 0.5
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 12))))
    deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    # Reference: the stop string complete first in the whole text; the longest of those ending there.
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    emitted, matched = _feed_all(StopChecker(stops, include), deltas)
    if found:
        end, _, stop = min(found)
        assert matched == stop
        assert emitted == text[:end if include else end - len(stop)]
    else:
        assert (emitted, matched) == (text, None)


def test_detokenizer_and_stop_checker_together(gemma):
    text = "Answer: 你好🎉 STOP ignored"
    out = gemma.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(gemma, gemma.encode("Q"))
    c = StopChecker([" STOP"], False)
    emitted, matched = "", None
    for t in out:
        piece, matched = c.feed(d.push([t]))
        emitted += piece
        if matched:
            break
    assert (emitted, matched) == ("Answer: 你好🎉", " STOP")

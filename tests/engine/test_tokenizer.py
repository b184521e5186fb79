"""Tokenizer loading (GGUF and Hugging Face directory), round trips, chat templates against transformers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pdserve.engine.tokenizer import (
    GEMMA3_CHAT_TEMPLATE,
    Tokenizer,
    gguf_tokenizer_dir,
    read_gguf_metadata,
    read_gguf_tokenizer_metadata,
)
from pdserve.model.default_model import resolve_model_path

TEXTS = [
    "Hello world",
    "  leading and  double  spaces, trailing ",
    "Héllo wörld, naïve café. 你好，世界！ 日本語 🎉👩‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "line one\nline two\n\n\ttabbed",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Héllo 你好 🎉"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model_path("default")


@pytest.fixture(scope="module")
def gemma(gguf_path) -> Tokenizer:
    # The first run on a machine converts the GGUF tokenizer (~20 s); later runs load the cached conversion.
    return Tokenizer.load(gguf_path)


@pytest.fixture(scope="module")
def gemma_hf(gguf_path):
    """transformers' own tokenizer over the same converted files: the oracle for rendering and encoding."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_tokenizer_dir(gguf_path)))


# ------------------------------------------------------------------ the default model (GGUF)
def test_gguf_special_ids_come_from_the_file(gemma, gguf_path):
    meta = read_gguf_tokenizer_metadata(Path(gguf_path))
    tokens = read_gguf_metadata(Path(gguf_path), keys={"tokenizer.ggml.tokens"})["tokenizer.ggml.tokens"]
    assert gemma.vocab_size == len(tokens)
    assert gemma.bos_token_id == meta["bos_id"]
    assert set(meta["eos_ids"]) <= gemma.eos_token_ids
    # Gemma 3 ends a chat turn with <end_of_turn>: generation must stop there too.
    assert gemma.token_to_id("<end_of_turn>") in gemma.eos_token_ids
    assert gemma.id_to_token(gemma.bos_token_id) == "<bos>"


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip(gemma, text):
    ids = gemma.encode(text)
    assert ids[0] == gemma.bos_token_id and gemma.bos_token_id not in ids[1:]
    assert gemma.decode(ids) == text
    plain = gemma.encode(text, add_special_tokens=False)
    assert plain == ids[1:]
    assert gemma.decode(plain) == text


def test_spaces_are_kept_in_tokens(gemma):
    ids = gemma.encode("Hello world", add_special_tokens=False)
    assert gemma.convert_ids_to_tokens(ids) == ["Hello", "▁world"]


def test_batch_paths_match_single(gemma):
    assert gemma.encode_batch(TEXTS) == [gemma.encode(t) for t in TEXTS]
    ids = [gemma.encode(t) for t in TEXTS]
    assert gemma.decode_batch(ids) == [gemma.decode(i) for i in ids]


def test_gguf_chat_template_is_the_files_or_gemma3s(gemma, gguf_path):
    meta = read_gguf_tokenizer_metadata(Path(gguf_path))
    assert gemma.chat_template == (meta["chat_template"] or GEMMA3_CHAT_TEMPLATE)


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_chat_template_renders_like_transformers(gemma, gemma_hf, conv):
    for gen in (True, False):
        ours = gemma.apply_chat_template(conv, add_generation_prompt=gen)
        theirs = gemma_hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    ids = gemma.encode_chat(conv)
    assert ids == list(gemma_hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert ids[0] == gemma.bos_token_id and ids.count(gemma.bos_token_id) == 1


def test_chat_template_errors_are_value_errors(gemma):
    with pytest.raises(ValueError, match="alternate"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="empty"):
        gemma.apply_chat_template([])
    with pytest.raises(ValueError, match="Invalid content type"):
        gemma.apply_chat_template([{"role": "user", "content": 5}])


def test_explicit_template_and_kwargs(gemma):
    out = gemma.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ bos_token }}{{ flavour }}",
                                    flavour="mint")
    assert out == "<bos>mint"


def test_cached_conversion_is_reused_and_fast(gemma, gguf_path):
    d = gguf_tokenizer_dir(gguf_path)
    before = (d / "tokenizer.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = Tokenizer.load(gguf_path)
    elapsed = time.perf_counter() - t0
    assert (d / "tokenizer.json").stat().st_mtime_ns == before
    assert again.encode("Hello world") == gemma.encode("Hello world")
    # The brief's target is < 2 s on a developer machine; a re-conversion would take ~20 s.
    assert elapsed < 5.0, f"cached tokenizer load took {elapsed:.1f} s"


# ------------------------------------------------------------------ a tiny GGUF carrying its own chat template
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tiny_llama_gguf(path: Path, chat_template: str | None) -> None:
    import gguf
    import numpy as np

    pieces = ["▁", "▁h", "▁hello", "▁w", "▁world", "e", "l", "o", "h", "w", "r", "d", "ll", "llo", "or", "orld"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces + ["<|im_start|>", "<|im_end|>"]
    normal, unknown, control, byte = (gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
                                      gguf.TokenType.BYTE)
    types = [unknown, control, control] + [byte] * 256 + [normal] * len(pieces) + [control, control]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_chat_template_from_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(path, TINY_TEMPLATE)
    tok = Tokenizer.load(str(path))
    assert tok.chat_template == TINY_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id == 1 and tok.decode(ids) == "hello world"
    assert tok.eos_token_ids == {2}
    # The conversion is cached under the cache dir and keyed by the file: touching the file converts again.
    (first,) = (tmp_path / "cache" / "tokenizers").glob("tiny-*/tokenizer.json")
    assert json.loads((first.parent / "pdserve_source.json").read_text())["chat_template_source"] == "gguf"
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    Tokenizer.load(str(path))
    assert len(list((tmp_path / "cache" / "tokenizers").glob("tiny-*/tokenizer.json"))) == 2


def test_gguf_without_template_raises_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "notemplate.gguf"
    _write_tiny_llama_gguf(path, None)
    tok = Tokenizer.load(str(path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_directory_with_a_single_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    _write_tiny_llama_gguf(tmp_path / "model" / "m.gguf", TINY_TEMPLATE)
    assert Tokenizer.load(str(tmp_path / "model")).chat_template == TINY_TEMPLATE


# ------------------------------------------------------------------ Hugging Face directories
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _build_byte_level_bpe_dir(d: Path) -> None:
    """A tiny GPT-2-style (byte-level BPE) tokenizer, trained here, saved as a Hugging Face directory."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tk = FastTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t for t in TEXTS if t] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
    tk.train_from_iterator(corpus, trainer)
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    d.mkdir(parents=True, exist_ok=True)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML,
    }))
    im_end = tk.token_to_id("<|im_end|>")
    endoftext = tk.token_to_id("<|endoftext|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext]}))


@pytest.fixture
def bpe_dir(tmp_path) -> Path:
    _build_byte_level_bpe_dir(tmp_path / "bpe")
    return tmp_path / "bpe"


def test_hf_dir_matches_transformers(bpe_dir):
    from transformers import AutoTokenizer

    tok = Tokenizer.load(str(bpe_dir))
    hf = AutoTokenizer.from_pretrained(str(bpe_dir))
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        assert tok.decode(tok.encode(text)) == text == hf.decode(hf.encode(text))
    for conv in CONVERSATIONS[:2]:
        assert tok.apply_chat_template(conv) == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert tok.encode_chat(conv) == list(hf.apply_chat_template(conv, add_generation_prompt=True,
                                                                     return_dict=False))


@pytest.mark.parametrize("add_bos,add_eos", [(True, False), (False, True), (True, True), (False, False)])
def test_hf_dir_add_bos_eos_flags_like_transformers(bpe_dir, add_bos, add_eos):
    """tokenizer.json's post-processor decides special tokens; transformers 5's generic tokenizer class agrees."""
    from transformers import AutoTokenizer

    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", add_bos_token=add_bos, add_eos_token=add_eos)
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(str(bpe_dir))
    hf = AutoTokenizer.from_pretrained(str(bpe_dir))
    assert tok.encode("hello world") == hf.encode("hello world")
    assert tok.encode("hello world", add_special_tokens=False) == hf.encode("hello world", add_special_tokens=False)


def test_hf_dir_chat_template_jinja_takes_precedence(bpe_dir):
    (bpe_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = Tokenizer.load(str(bpe_dir))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_hf_dir_named_templates(bpe_dir):
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": CHATML},
                               {"name": "tool_use", "template": "tools={{ tools | length if tools else 0 }}"}]
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(str(bpe_dir))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs).startswith("<|im_start|>user")
    assert tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools=1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use") == "tools=0"


def test_converted_gemma_cache_is_a_valid_hf_dir(gemma, gguf_path, tmp_path):
    """The default model's converted tokenizer, copied as a plain HF directory, loads the same."""
    src = gguf_tokenizer_dir(gguf_path)
    d = tmp_path / "gemma-hf"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        os.symlink(src / name, d / name)
    tok = Tokenizer.load(str(d))
    assert tok.eos_token_ids == gemma.eos_token_ids
    conv = CONVERSATIONS[1]
    assert tok.apply_chat_template(conv) == gemma.apply_chat_template(conv)
    assert tok.encode(TEXTS[2]) == gemma.encode(TEXTS[2])


# ------------------------------------------------------------------ clear errors
def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        Tokenizer.load(str(tmp_path / "nope"))


def test_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf"):
        Tokenizer.load(str(tmp_path / "weights.bin"))


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError):
        Tokenizer.load(str(tmp_path / "bad.gguf"))
    assert not list((tmp_path / "cache" / "tokenizers").glob("bad-*/tokenizer.json"))


def test_corrupt_tokenizer_json(bpe_dir):
    (bpe_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.load(str(bpe_dir))


def test_missing_tokenizer_json_with_config_only(tmp_path):
    d = tmp_path / "cfgonly"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises((FileNotFoundError, ValueError), match=str(d)):
        Tokenizer.load(str(d))


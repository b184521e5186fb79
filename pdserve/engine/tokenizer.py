"""Tokenizer: text <-> token ids and chat-template rendering for one model.

Why not just `transformers.AutoTokenizer`: in transformers 5 it re-parses tokenizer.json in Python and rebuilds
the model (3+ s for Gemma's 262k vocabulary), and the engine only needs the fast `tokenizers.Tokenizer` that
tokenizer.json fully describes (normalizer, pre-tokenizer, BPE/Unigram model, post-processor that adds BOS,
decoder). So we load that directly (~0.6 s), and render chat templates with transformers' own
`render_jinja_template`, the function `PreTrainedTokenizer.apply_chat_template` calls, with the same special-token
variables, so prompts render exactly as transformers renders them.

Sources:
- a Hugging Face directory: tokenizer.json (or, failing that, whatever AutoTokenizer can convert), chat template from
  chat_template.jinja / chat_template.json / tokenizer_config.json, special tokens from tokenizer_config.json and
  special_tokens_map.json, extra EOS ids from generation_config.json;
- a GGUF file: converted once by transformers (~15 s) and saved as a Hugging Face directory in the pdserve cache,
  keyed by the file's path, size and mtime (`pdserve.model.gguf.gguf_tokenizer_dir`), then loaded as above.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# GGUF handling lives beside the model loader; the names are re-exported here for existing callers.
from pdserve.model.gguf import (  # noqa: F401
    GEMMA3_CHAT_TEMPLATE,
    gguf_tokenizer_dir,
    read_gguf_metadata,
    read_gguf_tokenizer_metadata,
)

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a chat template sees as variables (bos_token, ...).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """A loaded tokenizer: fast encode/decode through `tokenizers`, chat templates rendered as transformers does."""

    def __init__(self, backend, *, special_tokens: dict[str, str], chat_template: str | dict[str, str] | None,
                 extra_eos_token_ids: list[int] | None = None, name_or_path: str = ""):
        self._tk = backend
        self._tk.no_truncation()
        self._tk.no_padding()
        self.name_or_path = name_or_path
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._id_of(special_tokens.get("bos_token"))
        self.eos_token_id: int | None = self._id_of(special_tokens.get("eos_token"))
        self.pad_token_id: int | None = self._id_of(special_tokens.get("pad_token"))
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids: set[int] = eos | set(extra_eos_token_ids or [])
        self.all_special_ids: set[int] = {
            tid for tid, tok in backend.get_added_tokens_decoder().items() if getattr(tok, "special", False)
        }

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a Hugging Face model directory or a .gguf file (or a directory holding exactly one .gguf)."""
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(
                f"no tokenizer at {str(path)!r}: no such file or directory (pdserve loads a local Hugging Face "
                "model directory or a .gguf file)"
            )
        if p.is_file():
            if p.suffix.lower() != ".gguf":
                raise ValueError(f"{p} is a file but not a .gguf file; pass a .gguf file or a model directory")
            return cls._load_dir(gguf_tokenizer_dir(p), name_or_path=str(p))
        if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                              "vocab.json")):
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls._load_dir(gguf_tokenizer_dir(ggufs[0]), name_or_path=str(ggufs[0]))
        return cls._load_dir(p, name_or_path=str(p))

    @classmethod
    def _load_dir(cls, d: Path, name_or_path: str) -> Tokenizer:
        from tokenizers import Tokenizer as FastTokenizer

        config = _read_json(d / "tokenizer_config.json")
        hf_fallback = None
        if (d / "tokenizer.json").exists():
            try:
                backend = FastTokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as exc:
                raise ValueError(f"{d / 'tokenizer.json'} could not be parsed: {exc}") from exc
        elif any((d / f).exists() for f in ("tokenizer.model", "vocab.json", "tokenizer_config.json")):
            hf_fallback = _auto_tokenizer(d)  # slow path: let transformers convert sentencepiece / vocab+merges
            backend = hf_fallback.backend_tokenizer
        else:
            raise FileNotFoundError(
                f"{d} has no tokenizer: expected tokenizer.json (or tokenizer.model / vocab.json + merges.txt with "
                "tokenizer_config.json), or a single .gguf file"
            )
        special = _read_special_tokens(d, config)
        if hf_fallback is not None:
            special = {**hf_fallback.special_tokens_map, **special}
        template = _read_chat_template(d, config)
        if template is None and hf_fallback is not None:
            template = hf_fallback.chat_template
        gen = _read_json(d / "generation_config.json")
        extra_eos = _as_id_list(gen.get("eos_token_id"))
        return cls(backend, special_tokens=special, chat_template=template, extra_eos_token_ids=extra_eos,
                   name_or_path=name_or_path)

    # ---------------------------------------------------------------- ids <-> text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Many texts at once; `tokenizers` runs them in parallel in Rust."""
        return [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tk.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tk.id_to_token(i) for i in ids]

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tk.token_to_id(token)

    # ---------------------------------------------------------------- chat
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """Pick the template as transformers does: a name or a template string, else tool_use/default/the one."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"{self.name_or_path} has several chat templates and no default: "
                             f"pass one of {sorted(templates)} as chat_template")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(
                f"{self.name_or_path or 'this tokenizer'} has no chat template: pass chat_template, or use the "
                "completions API with a plain prompt"
            )
        return templates

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                            chat_template: str | None = None, documents=None,
                            continue_final_message: bool = False, **kwargs) -> str:
        """Render `messages` to the prompt text (not tokenized). Template errors become ValueError (HTTP 400)."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        if not messages:
            raise ValueError("cannot apply a chat template to an empty list of messages")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        template = self.get_chat_template(chat_template, tools)
        # As transformers does: drop None-valued keys (OpenAI clients send content=None, tool_calls=None).
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            rendered, _ = render_jinja_template(
                conversations=[conversation], tools=tools, documents=documents, chat_template=template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **{**self.special_tokens_map, **kwargs},
            )
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
            # Raised by the template on messages it cannot render (its raise_exception, a missing key, None where
            # a string was expected): the request's fault, so a ValueError (HTTP 400), not a server error.
            raise ValueError(f"chat template error: {type(exc).__name__}: {exc}") from exc
        return rendered[0]

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """Render then encode without special tokens: the template already wrote BOS where the model wants it."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)})"


# -------------------------------------------------------------------- Hugging Face directory helpers
def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialized AddedToken {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_special_tokens(d: Path, config: dict) -> dict[str, str]:
    merged = {**_read_json(d / "special_tokens_map.json"), **config}
    out = {}
    for name in _SPECIAL_TOKEN_NAMES:
        content = _token_content(merged.get(name))
        if content is not None:
            out[name] = content
    return out


def _read_chat_template(d: Path, config: dict) -> str | dict[str, str] | None:
    """transformers' precedence: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(d / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template}
    return template if isinstance(template, (str, dict)) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _auto_tokenizer(d: Path, **kwargs):
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(d), **kwargs)
    except Exception as exc:
        raise ValueError(f"transformers could not load a tokenizer from {d}: {exc}") from exc
    if not getattr(hf, "is_fast", False) or not hasattr(hf, "backend_tokenizer"):
        raise ValueError(f"the tokenizer in {d} has no fast (tokenizers) backend, which pdserve needs")
    return hf

"""GGUF files: the model's weights and the tokenizer, each converted once by transformers' GGUF reader (which knows
every architecture's tensor names and conventions) into a Hugging Face directory in the pdserve cache, so later starts
load safetensors and tokenizer.json in about a second. Also a fast reader of GGUF metadata (the header only).

- `gguf_to_hf_dir`: config.json + model.safetensors, keyed by the file's path, size and mtime;
- `gguf_tokenizer_dir`: tokenizer files plus what transformers leaves out (chat template, end-of-turn ids).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.envs import cache_dir
from pdserve.model import MODEL_TYPE_TO_ARCH

# Gemma 3's chat template, verbatim from google/gemma-3-*-it tokenizer_config.json. GGUF files of Gemma 3 converted
# without it (such as the default model) carry no `tokenizer.chat_template`, and llama.cpp likewise falls back to a
# built-in template by architecture.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Per GGUF architecture: the chat template to use when the file has none, and end-of-turn tokens that end a
# generation besides tokenizer.ggml.eos_token_id (google's generation_config.json for Gemma 3 lists <eos> and
# <end_of_turn>).
_GGUF_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"chat_template": GEMMA3_CHAT_TEMPLATE, "eos_tokens": ["<end_of_turn>"]},
}

# Bump when the cached conversion's layout changes, so stale caches are rebuilt instead of misread.
_GGUF_CACHE_VERSION = 1

# -------------------------------------------------------------------- weights, dequantized once and cached
def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """Dequantize a GGUF into a cached HF directory (config.json + model.safetensors), once per file."""
    out = cache_dir() / "converted" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
    if (out / ".complete").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    print(f"pdserve: converting {gguf_path.name} to a cached Hugging Face directory in {out} (once)", file=sys.stderr)
    cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta_model)["tensors"]
    if getattr(cfg, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    d = cfg.to_dict()
    d["architectures"] = [MODEL_TYPE_TO_ARCH.get(d["model_type"], d["model_type"])]
    with open(tmp / "config.json", "w") as f:
        json.dump(d, f, indent=1)
    (tmp / ".complete").write_text(str(gguf_path))
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race: its copy is equally good
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -------------------------------------------------------------------- tokenizer, converted once and cached
def gguf_tokenizer_dir(gguf_path: str | os.PathLike) -> Path:
    """A Hugging Face tokenizer directory for `gguf_path`, converting (once, ~15 s) into the pdserve cache.

    Keyed by the file's resolved path, size and mtime, so a replaced file is converted again. Written to a temp
    directory and renamed, under a lock, so two processes starting together convert once and never see half a
    directory.
    """
    from pdserve.model.default_model import FileLock

    path = Path(gguf_path).resolve()
    st = path.stat()
    ident = f"v{_GGUF_CACHE_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = cache_dir() / "tokenizers"
    out = root / f"{path.stem}-{key}"
    if (out / "tokenizer.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f"{out.name}.lock", timeout_s=600.0):
        if (out / "tokenizer.json").exists():
            return out
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}."))
        try:
            _convert_gguf_tokenizer(path, tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


# GGUF metadata value types (gguf spec): struct format of each scalar type; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: Path, keys: set[str] | None = None, prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read GGUF key/values (only `keys` and keys starting with `prefixes`, or all if both are empty).

    Why not gguf.GGUFReader: it builds numpy views for every element of every array, 8 s for Gemma's 262k-token
    vocabulary; this skips arrays it is not asked for and reads only the header.
    """
    import mmap

    def want(key: str) -> bool:
        return (not keys and not prefixes) or (keys is not None and key in keys) or key.startswith(prefixes)

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(m[:4])!r})")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (or a big-endian file)")
        pos = 24

        def read_string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", m, pos)
            pos += 8 + n
            return m[pos - n:pos].decode("utf-8", errors="replace")

        def read_value(vtype: int, keep: bool):
            nonlocal pos
            if vtype == _GGUF_STRING:
                if keep:
                    return read_string()
                (n,) = struct.unpack_from("<Q", m, pos)
                pos += 8 + n
                return None
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if etype in _GGUF_SCALARS and not keep:
                    pos += count * struct.calcsize("<" + _GGUF_SCALARS[etype])
                    return None
                items = [read_value(etype, keep) for _ in range(count)]
                return items if keep else None
            fmt = _GGUF_SCALARS.get(vtype)
            if fmt is None:
                raise ValueError(f"{path}: unknown GGUF value type {vtype} at byte {pos}")
            (value,) = struct.unpack_from("<" + fmt, m, pos)
            pos += struct.calcsize("<" + fmt)
            return value

        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = read_string()
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos += 4
            keep = want(key)
            value = read_value(vtype, keep)
            if keep:
                out[key] = value
        return out


def read_gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The GGUF fields the conversion needs that transformers does not carry over (chat templates, end ids)."""
    try:
        kv = read_gguf_metadata(path, keys={"general.architecture", "tokenizer.ggml.eos_token_id",
                                            "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                                            "tokenizer.ggml.bos_token_id"},
                                prefixes=("tokenizer.chat_template",))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    prefix = "tokenizer.chat_template."
    return {
        "architecture": kv.get("general.architecture"),
        "chat_template": kv.get("tokenizer.chat_template"),
        "named_chat_templates": {k[len(prefix):]: v for k, v in kv.items() if k.startswith(prefix)},
        "bos_id": kv.get("tokenizer.ggml.bos_token_id"),
        "eos_ids": [kv[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                    "tokenizer.ggml.eom_token_id") if isinstance(kv.get(k), int)],
    }


def _convert_gguf_tokenizer(path: Path, out: Path) -> None:
    """Convert with transformers, then add what it leaves out: the chat template and end-of-turn ids."""
    print(f"pdserve: converting the tokenizer of {path} (once, ~20 s) into {out.parent} ...", file=sys.stderr,
          flush=True)
    hf = _gguf_fast_tokenizer(path)
    hf.save_pretrained(str(out))
    meta = read_gguf_tokenizer_metadata(path)
    arch = _GGUF_ARCH_DEFAULTS.get(meta["architecture"] or "", {})

    template: str | list | None = meta["chat_template"]
    source = "gguf" if template else None
    if not template and arch.get("chat_template"):
        template, source = arch["chat_template"], f"builtin:{meta['architecture']}"
    if meta["named_chat_templates"]:
        named = [{"name": n, "template": t} for n, t in meta["named_chat_templates"].items()]
        template = ([{"name": "default", "template": template}] if template else []) + named

    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    if template:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    backend = hf.backend_tokenizer
    eos_ids = list(meta["eos_ids"])
    for tok in arch.get("eos_tokens", []):
        tid = backend.token_to_id(tok)
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    if eos_ids:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}), encoding="utf-8")
    st = path.stat()
    (out / "pdserve_source.json").write_text(json.dumps({
        "gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "chat_template_source": source,
    }, indent=2), encoding="utf-8")


def _gguf_fast_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ValueError(f"transformers could not load a tokenizer from {path}: {exc}") from exc
    if not getattr(hf, "is_fast", False) or not hasattr(hf, "backend_tokenizer"):
        raise ValueError(f"the tokenizer in {path} has no fast (tokenizers) backend, which pdserve needs")
    return hf

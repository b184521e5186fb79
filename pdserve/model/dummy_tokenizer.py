"""A word-level tokenizer for shipped shapes (random weights, no checkpoint): token id i is the word `t<i>`, so any
token ids decode to text that encodes back to exactly those ids, and benchmarks get exact prompt lengths."""

from __future__ import annotations

import json
import os
from pathlib import Path


def wordlevel_tokenizer_dir(cfg, cache_root: Path) -> Path:
    vocab_size = int(cfg.vocab_size)
    bos = getattr(cfg, "bos_token_id", None)
    eos = getattr(cfg, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    out = cache_root / "tokenizers" / f"wordlevel-{vocab_size}-{bos}-{eos}"
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
          "model_max_length": int(getattr(cfg, "max_position_embeddings", 8192))}
    if bos is not None:
        tc["bos_token"] = f"t{bos}"
    if eos is not None:
        tc["eos_token"] = f"t{eos}"
    (tmp / "tokenizer_config.json").write_text(json.dumps(tc))
    try:
        os.replace(tmp, out)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_path_for(source, cfg=None) -> str:
    """Where the tokenizer of a model source lives; shipped shapes get the word-level one."""
    if source.kind != "shipped":
        return str(source.path)
    from pdserve.envs import cache_dir
    from pdserve.model.loader import load_config

    if cfg is None:
        cfg, _ = load_config(source)
    return str(wordlevel_tokenizer_dir(cfg, cache_dir()))

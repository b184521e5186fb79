"""Find a model's config and weights (Hugging Face directory, GGUF file, or a shipped shape for dummy weights) and
build it on the target device.

GGUF files are dequantized once with transformers' GGUF reader (which knows each architecture's tensor names and
conventions) and cached as a Hugging Face directory, so later starts load safetensors in about a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pdserve.envs import cache_dir
from pdserve.model import get_model_class
from pdserve.model.parallel import full_shape, load_param, shard_of, take_shard

log = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).parent / "configs"
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


@dataclass
class ModelSource:
    kind: str  # "hf_dir" | "gguf" | "shipped"
    path: Path  # directory, .gguf file, or shipped config.json
    name: str  # what the user asked for


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))


def resolve_model(model: str | None) -> ModelSource:
    """Turn `--model` into a source; the default name resolves to the embedded Gemma 3 270M GGUF."""
    from pdserve.model.default_model import resolve_model_path

    name = model or "default"
    path_str = resolve_model_path(model)
    path = Path(path_str).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return ModelSource("hf_dir", path, name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, name)
    if path.is_file() and path.name.endswith(".json"):
        return ModelSource("shipped", path, name)
    shipped = SHIPPED_CONFIGS / f"{path_str}.json"
    if shipped.exists():
        return ModelSource("shipped", shipped, name)
    raise FileNotFoundError(
        f"model {path_str!r} not found: give a Hugging Face model directory, a .gguf file, or one of the shipped "
        f"shapes for --load-format dummy ({', '.join(shipped_config_names())})"
    )


def _config_from_dict(d: dict):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ValueError("config has no model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as e:
        raise ValueError(f"unsupported model type {model_type!r}: {e}") from e
    return cfg


def text_config(cfg):
    """Multimodal configs (Gemma 3 4B+) carry the language model's settings in text_config."""
    archs = getattr(cfg, "architectures", None) or []
    if hasattr(cfg, "text_config") and cfg.text_config is not None and getattr(cfg, "model_type", "") != "gemma3_text":
        tc = cfg.text_config
        tc.architectures = archs
        return tc
    return cfg


def load_config(source: ModelSource):
    if source.kind == "gguf":
        source = ModelSource("hf_dir", gguf_to_hf_dir(source.path), source.name)
    cfg_path = source.path / "config.json" if source.kind == "hf_dir" else source.path
    with open(cfg_path) as f:
        d = json.load(f)
    archs = d.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "?")]
    get_model_class(archs)  # fail early, naming the architecture
    cfg = text_config(_config_from_dict(d))
    cfg.architectures = archs
    return cfg, source


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """Dequantize a GGUF into a cached HF directory (config.json + model.safetensors), once per file."""
    out = cache_dir() / "converted" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
    if (out / ".complete").exists():
        return out
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
    d["architectures"] = [_MODEL_TYPE_TO_ARCH.get(d["model_type"], d["model_type"])]
    with open(tmp / "config.json", "w") as f:
        json.dump(d, f, indent=1)
    (tmp / ".complete").write_text(str(gguf_path))
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race: its copy is equally good
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _map_name(name: str) -> str | None:
    for prefix, repl in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(prefix):
            return repl + name[len(prefix) :]
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")):
        return None
    return name


def _iter_safetensors(model_dir: Path):
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            wanted = sorted(set(json.load(f)["weight_map"].values()))
        missing = [w for w in wanted if not (model_dir / w).exists()]
        if missing:
            raise FileNotFoundError(f"weight files listed in {index.name} are missing: {', '.join(missing)}")
        files = [model_dir / w for w in wanted]
    for fp in files:
        with safe_open(str(fp), framework="pt") as f:
            for k in f.keys():
                yield k, f.get_slice(k)  # lazy: a tensor-parallel rank reads only its rows (model.parallel)


def load_weights(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    kv_scales = {n: b for n, b in model.named_buffers() if n.endswith((".k_scale", ".v_scale"))}  # fp8 KV, optional
    tied = getattr(model.config, "tie_word_embeddings", False) or type(model).__name__.startswith("Gemma3")
    loaded: set[str] = set()
    for name, lazy in _iter_safetensors(model_dir):
        mapped = _map_name(name)
        if mapped in kv_scales:
            kv_scales[mapped].copy_(lazy[()].reshape(()).float())
            continue
        if mapped is None or mapped not in params:
            continue
        load_param(params[mapped], lazy, name)  # the shape check, and this rank's shard of a sharded parameter
        loaded.add(mapped)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of a realistic scale, so benchmark runs need no checkpoint."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if type(model).__name__.startswith("Gemma3") else 1.0)
                continue
            # generate on CPU in chunks for determinism across devices, then copy; a tensor-parallel shard draws
            # the whole tensor and keeps its rows, so every TP size builds the same model
            sharded = shard_of(p) is not None
            full = torch.empty(full_shape(p), dtype=p.dtype) if sharded else p
            flat = full.view(-1)
            step = 1 << 24
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                flat[i : i + n].copy_((torch.rand(n, generator=gen) * 2 - 1) * 0.02)
            if sharded:
                take_shard(p, full)


def choose_dtype(dtype: str, device: torch.device, cfg) -> torch.dtype:
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "half": torch.float16}
    if dtype != "auto":
        if dtype not in names:
            raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
        return names[dtype]
    if device.type == "cpu":
        return torch.float32
    cfg_dtype = str(getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16").replace("torch.", "")
    return torch.float16 if cfg_dtype == "float16" else torch.bfloat16


def build_model(cfg, source: ModelSource, device: torch.device, dtype: torch.dtype, load_format: str, seed: int):
    cls = get_model_class(cfg.architectures)
    if load_format == "auto":
        load_format = "dummy" if source.kind == "shipped" else "safetensors"
    if source.kind == "shipped" and load_format != "dummy":
        raise ValueError(f"{source.name!r} is a shipped shape without weights: use --load-format dummy")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    # rotary tables stay float32 whatever the model dtype
    for m in model.modules():
        if hasattr(m, "cos") and isinstance(m.cos, torch.Tensor):
            m.cos, m.sin = m.cos.float(), m.sin.float()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, source.path)
    model.eval()
    return model

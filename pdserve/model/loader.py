"""Find a model's config and weights (Hugging Face directory, GGUF file, or a shipped shape for dummy weights) and
build it on the target device.

GGUF files are dequantized once into a cached Hugging Face directory (pdserve.model.gguf), so every model loads from
safetensors. Checkpoint tensors are read one at a time and copied into the model's parameters by name; a model whose
parameters do not match the checkpoint's names one to one (stacked MoE experts) maps each name to a parameter and
the part of it the tensor fills (`WeightTarget`, through the model's `checkpoint_target(name)`).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pdserve.model import MODEL_TYPE_TO_ARCH, get_model_class
from pdserve.model.merged import stacked_at_build
from pdserve.model.parallel import full_shape, load_param, shard_of, take_shard

log = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).parent / "configs"


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
        from pdserve.model.gguf import gguf_to_hf_dir

        source = ModelSource("hf_dir", gguf_to_hf_dir(source.path), source.name)
    cfg_path = source.path / "config.json" if source.kind == "hf_dir" else source.path
    with open(cfg_path) as f:
        d = json.load(f)
    archs = d.get("architectures") or [MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "?")]
    get_model_class(archs)  # fail early, naming the architecture
    cfg = text_config(_config_from_dict(d))
    cfg.architectures = archs
    return cfg, source


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


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: model parameter `param`, or the part of it that `index` selects
    (e.g. `(expert, slice(0, I))`, an expert's gate rows in a stacked `w13 [E, 2I, H]`)."""

    param: str
    index: tuple = ()


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its parameter (or part of one), one tensor in memory at a time; fail on a
    shape mismatch, on a part written twice, and on any parameter not completely written."""
    params = dict(model.named_parameters())
    kv_scales = {n: b for n, b in model.named_buffers() if n.endswith((".k_scale", ".v_scale"))}  # fp8 KV, optional
    tied = getattr(model.config, "tie_word_embeddings", False) or type(model).__name__.startswith("Gemma3")
    target_of = getattr(model, "checkpoint_target", None)
    written: dict[str, int] = {}  # parameter -> elements written (a part, or this rank's whole shard)
    parts: set[tuple[str, str]] = set()
    for name, lazy in _iter_safetensors(model_dir):
        mapped = _map_name(name)
        if mapped in kv_scales:
            kv_scales[mapped].copy_(lazy[()].reshape(()).float())
            continue
        if mapped is None:
            continue
        target = (target_of(mapped) if target_of is not None else None) or WeightTarget(mapped)
        if target.param not in params:
            continue
        param = params[target.param]
        part = (target.param, repr(target.index))
        if part in parts:
            raise ValueError(f"weight {name} writes part of {target.param} a second time: the checkpoint holds the "
                             "same weights twice (per expert and stacked?)")
        if target.index:  # a part of a stacked parameter (MoE experts): read whole, checked against that part
            tensor = lazy[()]
            dest = param.data[target.index]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(dest.shape)} at {target.param}{list(target.index)}")
            if written.get(target.param, 0) + tensor.numel() > param.numel():
                raise ValueError(f"weight {name} writes part of {target.param} a second time: the checkpoint holds "
                                 "the same weights twice (per expert and stacked?)")
            with torch.no_grad():
                dest.copy_(tensor)
            written[target.param] = written.get(target.param, 0) + tensor.numel()
        else:  # the shape check, and this rank's shard of a tensor-parallel parameter
            if written.get(target.param, 0):
                raise ValueError(f"weight {name} writes {target.param} a second time: the checkpoint holds the same "
                                 "weights twice (per expert and stacked?)")
            load_param(param, lazy, name)
            written[target.param] = param.numel()
        parts.add(part)
    missing = [n for n, p in params.items()
               if written.get(n, 0) < p.numel() and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr_(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic), into a new tensor."""
    return torch.bitwise_right_shift(z, s).bitwise_and_((1 << (64 - s)) - 1)


def hash_uniform(start: int, n: int, key: int, device: torch.device) -> torch.Tensor:
    """Values start..start+n-1 of a stream of float32 in [-1, 1): a counter-based hash (splitmix64's finaliser) of
    (key, counter), two 24-bit values per 64-bit hash. Integer arithmetic wraps identically everywhere, so the
    values are the same on CPU and any GPU; on a GPU a billion take milliseconds."""
    first, last = start // 2, (start + n + 1) // 2
    z = torch.arange(first, last, dtype=torch.int64, device=device)
    z.add_(_signed64((key * _GOLDEN) % (1 << 64)))
    z.bitwise_xor_(_shr_(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr_(z, 27)).mul_(_MIX2)
    z.bitwise_xor_(_shr_(z, 31))
    pair = torch.stack((_shr_(z, 40), torch.bitwise_right_shift(z, 16).bitwise_and_((1 << 24) - 1)), dim=1)
    out = pair.view(-1)[start - 2 * first: start - 2 * first + n].to(torch.float32)
    return out.mul_(2.0**-23).sub_(1.0)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of a realistic scale (uniform in ±0.02; norms at their neutral value), so benchmark runs need
    no checkpoint. Each parameter's values depend only on (seed, its name, position): identical on every device and
    in every process, generated where the parameter lives."""
    import zlib

    gemma = type(model).__name__.startswith("Gemma3")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if gemma else 1.0)
                continue
            # a tensor-parallel shard computes the whole tensor's values and keeps its run, so every TP size builds
            # the same model
            key = (seed << 32) ^ zlib.crc32(name.encode())
            sharded = shard_of(p) is not None
            full = torch.empty(full_shape(p), dtype=p.dtype, device=p.device) if sharded else p
            flat = full.view(-1)
            step = 1 << 24
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                flat[i : i + n].copy_(hash_uniform(i, n, key, p.device).mul_(0.02))
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


@contextmanager
def _no_default_init():
    """Modules built without their default random init: every parameter is then written by `load_weights` (which
    fails on any it did not write) or `init_dummy_weights`. nn.Linear's kaiming init cost 0.9 s of a 5 s CPU start
    of the default model."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(cfg, source: ModelSource, device: torch.device, dtype: torch.dtype, load_format: str, seed: int):
    cls = get_model_class(cfg.architectures)
    if load_format == "auto":
        load_format = "dummy" if source.kind == "shipped" else "safetensors"
    if source.kind == "shipped" and load_format != "dummy":
        raise ValueError(f"{source.name!r} is a shipped shape without weights: use --load-format dummy")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _no_default_init(), stacked_at_build():
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

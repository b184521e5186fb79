"""Read RoPE settings from a Hugging Face config across transformers versions (4.x `rope_theta`/`rope_scaling`,
5.x `rope_parameters`, per layer type for Gemma 3)."""

from __future__ import annotations


def rope_params(cfg, layer_type: str | None = None) -> tuple[float, dict | None]:
    """Return (base, scaling dict or None) for the layers of `layer_type` ("full_attention"/"sliding_attention")."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        if layer_type is not None and layer_type in rp and isinstance(rp[layer_type], dict):
            rp = rp[layer_type]
        elif "full_attention" in rp and isinstance(rp["full_attention"], dict):
            rp = rp["full_attention"]
        base = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return base, scaling
    # transformers 4.x
    if layer_type == "sliding_attention" and getattr(cfg, "rope_local_base_freq", None) is not None:
        return float(cfg.rope_local_base_freq), None
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(getattr(cfg, "rope_theta", 10000.0)), scaling

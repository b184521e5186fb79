"""bench_steps.py's GPU timeline (the async decode loop under the profiler): busy time is the union of the device's
intervals, idle time the rest of their span, and the longest gaps name the activity on either side; each activity's
marginal time (how far it pushes the device's latest end) sums to the busy time."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "bench_steps.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_steps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ev(name, start, end, cuda=True):
    dev = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=start, end=end))


def test_busy_idle_and_gaps():
    # two steps: a (0-100) overlapping b (50-120), a 30 us gap, c (150-200) containing d (160-170), a 100 us gap,
    # e (300-400); host events are ignored
    events = [_ev("a", 0, 100), _ev("b", 50, 120), _ev("c", 150, 200), _ev("d", 160, 170), _ev("e", 300, 400),
              _ev("host", 0, 1000, cuda=False)]
    g = _module().gpu_timeline(SimpleNamespace(events=lambda: events), steps=2)
    assert g["span_us_per_step"] == 200 and g["busy_us_per_step"] == (120 + 50 + 100) / 2
    assert g["idle_us_per_step"] == (30 + 100) / 2 and g["gaps_over_20us_per_step"] == 1
    assert [(x["us"], x["after"], x["before"]) for x in g["longest_gaps"]] == [(100, "c", "e"), (30, "b", "c")]
    assert _module().gpu_timeline(SimpleNamespace(events=lambda: events[-1:]), steps=2) == {}


def test_marginal_times_sum_to_the_busy_time():
    # a (0-100); b starts early under PDL (50) and ends at 130: it adds 30; c inside b adds 0; a gap, then d adds 50;
    # e (220-240) after a 20 us gap adds 20
    events = [_ev("a", 0, 100), _ev("b", 50, 130), _ev("c", 60, 120), _ev("d", 150, 200), _ev("e", 220, 240),
              _ev("host", 0, 1000, cuda=False)]
    m = _module().marginal_times(SimpleNamespace(events=lambda: events))
    assert dict(m) == {"a": [100], "b": [30], "c": [0.0], "d": [50], "e": [20]}
    g = _module().gpu_timeline(SimpleNamespace(events=lambda: events), steps=1)
    assert sum(sum(v) for v in m.values()) == g["busy_us_per_step"]


def test_floor_and_serial_bound_of_a_step():
    """floors(): the floor is the larger of the step's bytes at the copy rate and its FLOPs at the matmul rate; the
    serial bound adds the attention's larger part to the products' larger part. Round numbers: 1e9 bytes and 1e9
    FLOPs a ms, weights of 2e9 bytes, 1e6 bytes of KV a token."""
    mod = _module()
    sizes = {"weight_bytes_read": 2_000_000_000, "linear_params": 1_000_000_000, "lm_head_params": 0,
             "kv_bytes_per_token": 1_000_000, "attn_flops_per_pair": 0}
    ceil = {"hbm_copy_gbps": 1000.0, "bf16_matmul_tflops": 1.0}  # 1e9 bytes and 1e9 FLOPs a ms
    # 4 decode rows at 999 cached tokens: KV 4e9 bytes (4 ms), weights 2 ms, products 2 * 4 * 1e9 = 8e9 FLOPs (8 ms)
    f = mod.floors(sizes, ceil, [(999, 1)] * 4, 4)
    assert f["kv_bytes_read"] == 4_000_000_000 and f["flops"] == 8_000_000_000
    assert (f["memory_floor_ms"], f["compute_floor_ms"], f["floor_ms"], f["bound"]) == (6.0, 8.0, 8.0, "compute")
    assert f["serial_bound_ms"] == 4.0 + 8.0  # the KV read, then the products at the matmul rate
    # one row: the products' weights' read (2 ms) outlasts their FLOPs (2 ms: equal), the KV 1 ms
    f1 = mod.floors(sizes, ceil, [(999, 1)], 1)
    assert (f1["floor_ms"], f1["serial_bound_ms"]) == (3.0, 3.0)
    loop = {"rows_per_step": 4.0, "mean_context": 999.0, "step_ms": 16.0}
    got = mod.loop_floor(sizes, ceil, loop)
    assert got == {"floor_ms": 8.0, "fraction_of_floor": 0.5, "serial_bound_ms": 12.0,
                   "fraction_of_serial_bound": 0.75}


def test_a_mixture_of_experts_counts_the_experts_its_tokens_route_to():
    """floors() with stacked experts: a token multiplies top_k of E experts' weights, and a step reads the share of
    them its tokens route to (1 - (1 - k/E) ** tokens, uniform routing). 8 experts, top 2; expert weights of 8e9 bytes
    and 8e9 params; dense weights 1e9 bytes and params."""
    mod = _module()
    sizes = {"weight_bytes_read": 1_000_000_000, "linear_params": 1_000_000_000, "lm_head_params": 0,
             "kv_bytes_per_token": 0, "attn_flops_per_pair": 0, "expert_params": 8_000_000_000,
             "expert_bytes": 8_000_000_000, "num_experts": 8, "top_k": 2}
    ceil = {"hbm_copy_gbps": 1000.0, "bf16_matmul_tflops": 1.0}  # 1e9 bytes and 1e9 FLOPs a ms
    one = mod.floors(sizes, ceil, [(10, 1)], 1)
    assert one["weight_bytes"] == 1e9 + 8e9 * 2 / 8  # one token reads its two experts
    assert one["prod_flops"] == 2 * (1e9 + 8e9 * 2 / 8)
    two = mod.floors(sizes, ceil, [(10, 1)] * 2, 2)
    assert two["weight_bytes"] == 1e9 + 8e9 * (1 - 0.75 ** 2)  # two tokens: the experts either routes to
    many = mod.floors(sizes, ceil, [(0, 4096)], 1)
    assert abs(many["weight_bytes"] - 9e9) < 1  # a long prompt reads them all
    assert many["prod_flops"] == 2 * 4096 * (1e9 + 2e9)
    dense = {k: v for k, v in sizes.items() if not k.startswith(("expert", "num_", "top_"))}
    assert mod.floors(dense, ceil, [(10, 1)], 1)["weight_bytes"] == 1e9  # records without experts: as before


def test_model_sizes_set_the_stacked_experts_apart(tmp_path):
    """model_sizes() on a tiny Qwen3-MoE (8 experts, top 2, 4 layers, one of them dense): the experts' stacks are
    counted apart from the weights every step reads and the matrices every token multiplies."""
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from tests.engine.tiny_models import write_tiny_model

    path = write_tiny_model("qwen3_moe", tmp_path / "moe")
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", num_gpu_blocks=16))
    sizes = _module().model_sizes(core)
    per_layer = 8 * (2 * 32 * 64 + 64 * 32)  # w13 [E, 2I, H] and w2 [E, H, I]
    assert (sizes["num_experts"], sizes["top_k"]) == (8, 2)
    assert sizes["expert_params"] == 3 * per_layer and sizes["expert_bytes"] == 4 * 3 * per_layer
    params = dict(core.model.named_parameters())
    every = sum(p.numel() for n, p in params.items() if ".layers." in n and p.dim() == 2)
    assert sizes["linear_params"] == every  # attention, the routers and the dense layer's MLP
    total = sum(p.numel() * p.element_size() for p in params.values())
    assert sizes["weight_bytes_read"] == total - sizes["expert_bytes"] - params["model.embed_tokens.weight"].numel() * 4

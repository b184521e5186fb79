"""Dummy weights: a counter-based hash, so every parameter's values depend only on (seed, name, position) — the same
in every process and on every device (CPU here, CUDA in the gpu test) — uniform in ±0.02, norms neutral."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.loader import hash_uniform, init_dummy_weights
from pdserve.model.qwen3_moe import Qwen3MoeForCausalLM
from tests.engine.tiny_models import TINY

CPU = torch.device("cpu")


def test_hash_stream_is_uniform_and_position_consistent():
    u = hash_uniform(0, 1 << 20, 7, CPU)
    assert u.dtype == torch.float32 and -1.0 <= float(u.min()) and float(u.max()) < 1.0
    hist = torch.histc(u, bins=16, min=-1, max=1) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 2e-3
    assert abs(float(u.mean())) < 3e-3 and abs(float(u.std()) - 3**-0.5) < 3e-3
    for start, n in [(0, 1), (1, 1), (101, 10), (1 << 19, 77)]:  # any window of the stream is the same values
        assert torch.equal(hash_uniform(start, n, 7, CPU), u[start:start + n])
    other = hash_uniform(0, 1 << 20, 8, CPU)
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 1e-2
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 1e-2


def _tiny_moe():
    import transformers

    cfg = transformers.Qwen3MoeConfig(**TINY["qwen3_moe"]["kw"])
    return Qwen3MoeForCausalLM(cfg).float()


def test_dummy_weights_are_reproducible_and_realistic():
    a, b = _tiny_moe(), _tiny_moe()
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        pa, pb = pa.detach(), pb.detach()
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.all(pa == 1.0)
        else:
            assert float(pa.abs().max()) <= 0.02 and float(pa.abs().mean()) > 0.008, name
    c = _tiny_moe()
    init_dummy_weights(c, seed=4)
    assert not torch.equal(a.model.layers[0].mlp.experts.w13, c.model.layers[0].mlp.experts.w13)
    w13 = a.model.layers[0].mlp.experts.w13
    assert not torch.equal(w13[0], w13[1])  # experts differ from one another


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dummy_weights_are_the_same_on_cuda():
    cpu = _tiny_moe()
    with torch.device("cuda"):
        gpu = _tiny_moe()
    init_dummy_weights(cpu, seed=0)
    init_dummy_weights(gpu, seed=0)
    for (name, pc), pg in zip(cpu.named_parameters(), gpu.parameters()):
        assert torch.equal(pc, pg.cpu()), name
    n = 1 << 24
    assert torch.equal(hash_uniform(12345, n, 99, torch.device("cuda")).cpu(), hash_uniform(12345, n, 99, CPU))

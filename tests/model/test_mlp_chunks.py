"""A step longer than MLP_CHUNK_TOKENS goes through the gated MLP in parts: the same output as one pass, and
temporaries the size of a part."""

from __future__ import annotations

import torch

from pdserve.model import layers
from tests.engine.live_bytes import LiveBytes


def _mlp(hidden: int = 64, inter: int = 256) -> layers.GatedMLP:
    torch.manual_seed(0)
    mlp = layers.GatedMLP(hidden, inter, "silu")
    for p in mlp.parameters():
        p.data.normal_(0, 0.05)
    mlp.gate_up_weight.data.normal_(0, 0.05)
    return mlp


def test_parts_give_one_pass_output(monkeypatch):
    mlp = _mlp()
    x = torch.randn(37, 64)
    whole = mlp(x)
    monkeypatch.setattr(layers, "MLP_CHUNK_TOKENS", 8)
    parts = mlp(x)
    assert parts.shape == whole.shape
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_parts_bound_the_temporaries(monkeypatch):
    mlp = _mlp()
    x = torch.randn(512, 64)

    def peak() -> int:
        mode = LiveBytes()
        with torch.no_grad(), mode:
            mlp(x)
        return mode.peak

    whole = peak()
    assert whole >= 512 * 3 * 256 * 4  # gate/up and the activation's output for every row at once
    monkeypatch.setattr(layers, "MLP_CHUNK_TOKENS", 64)
    # the counter also sees the input and the weights (through views); beyond them: one part's gate/up and
    # activation, and the one output every part writes into
    seen = x.nbytes + mlp.gate_up_weight.nbytes + mlp.down_proj.weight.nbytes
    assert peak() <= seen + 64 * 3 * 256 * 4 + 512 * 64 * 4

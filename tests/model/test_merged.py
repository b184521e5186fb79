"""Merged projections (pdserve.model.merged): inside `stacked_at_build`, as build_model makes a model, each merged
projection allocates its stacked weight only (its parts are made on the meta device, so no freed part leaves a hole
in the GPU allocator's segments); elsewhere the parts are made, then stacked with their values."""

from __future__ import annotations

import pytest
import torch

import pdserve.model.merged as merged
from pdserve.model.layers import GatedMLP
from pdserve.model.merged import stacked_at_build
from pdserve.model.parallel import shard_of
from pdserve.parallel.group import TPGroup, tp_context


def _no_cat(*a, **k):
    raise AssertionError("a part was allocated and then copied into the stack")


def test_a_built_projection_allocates_only_its_stack(monkeypatch):
    with monkeypatch.context() as m, torch.device("cpu"), stacked_at_build():
        m.setattr(merged.torch, "cat", _no_cat)
        mlp = GatedMLP(8, 12, "silu")
    stacked = mlp.gate_up_weight
    assert stacked.shape == (24, 8) and stacked.device.type == "cpu"
    assert mlp.gate_proj.weight.data_ptr() == stacked.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == stacked[12:].data_ptr()
    assert isinstance(mlp.up_proj.weight, torch.nn.Parameter) and mlp.up_proj.weight.requires_grad
    assert not any(p.is_meta for p in mlp.parameters())
    # a checkpoint's matrices, loaded by their Hugging Face names, land in the stack
    sd = {k: torch.randn_like(v) for k, v in mlp.state_dict().items()}
    mlp.load_state_dict(sd)
    torch.testing.assert_close(stacked, torch.cat([sd["gate_proj.weight"], sd["up_proj.weight"]]), rtol=0, atol=0)


def test_outside_a_build_the_parts_keep_their_values():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 12, "silu")
    assert mlp.gate_proj.weight.abs().sum() > 0  # nn.Linear's init, kept through the stacking
    torch.testing.assert_close(mlp.gate_up_weight[:12], mlp.gate_proj.weight, rtol=0, atol=0)
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[12:].data_ptr()


@pytest.mark.parametrize("build", [False, True])
def test_a_shard_keeps_its_spec(build):
    with torch.device("cpu"), tp_context(TPGroup(1, 2)):
        if build:
            with stacked_at_build():
                mlp = GatedMLP(8, 12, "silu")
        else:
            mlp = GatedMLP(8, 12, "silu")
    assert mlp.gate_up_weight.shape == (12, 8)
    spec = shard_of(mlp.up_proj.weight)
    assert spec is not None and (spec.start, spec.length) == (6, 6)

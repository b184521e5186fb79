"""The MLP's passes over a long step: parts of MLP_CHUNK_TOKENS, and no last part of a few rows (which would run the
few-row product kernels, the one-row gate_up kernel among them, that no warm-up step compiles)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.layers import MLP_CHUNK_TOKENS, GatedMLP, mlp_parts
from pdserve.ops.linear import SKINNY_MAX_ROWS

C = MLP_CHUNK_TOKENS


@pytest.mark.parametrize("n, parts", [
    (C + 1, [(0, C + 1)]),
    (C + SKINNY_MAX_ROWS, [(0, C + SKINNY_MAX_ROWS)]),
    (C + SKINNY_MAX_ROWS + 1, [(0, C), (C, C + SKINNY_MAX_ROWS + 1)]),
    (2 * C, [(0, C), (C, 2 * C)]),
    (2 * C + 1, [(0, C), (C, 2 * C + 1)]),
    (3 * C + 5, [(0, C), (C, 2 * C), (2 * C, 3 * C + 5)]),
])
def test_parts_cover_the_step_and_none_is_a_few_rows(n, parts):
    got = mlp_parts(n)
    assert got == parts
    assert got[0][0] == 0 and got[-1][1] == n and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all(e - s > SKINNY_MAX_ROWS for s, e in got)


def test_a_long_step_with_a_one_row_tail_is_the_unchunked_product():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 16, "silu").double()
    x = torch.randn(C + 1, 8, dtype=torch.float64)
    gate, up = mlp.gate_up_weight.split(16)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()), mlp.down_proj.weight)
    assert torch.allclose(mlp(x), ref, atol=1e-12)

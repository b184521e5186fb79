"""Gated activations over a merged gate_up output against the torch reference: SiLU (Llama, Qwen3), GELU-tanh
(Gemma 3) and erf GELU; odd intermediate sizes, 1/3/257 tokens."""

from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_cases import DEVICE_DTYPES, assert_close, gen, randn

pytest.importorskip("triton")

from pdserve.ops.activation import act_and_mul_ref, act_and_mul_triton  # noqa: E402


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 2048), (3, 640), (257, 96), (2, 1500), (4, 12288)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
def test_act_and_mul(device, dtype, tokens, inter, act):
    g = gen(tokens * 31 + inter)
    x = randn((tokens, 2 * inter), g, device, dtype, 3.0)
    out = act_and_mul_triton(x, act)
    assert out.shape == (tokens, inter)
    assert_close(out, act_and_mul_ref(x, act))


def test_gate_and_up_are_not_swapped():
    g = gen(9)
    x = randn((3, 128), g, "cpu", torch.float32, 3.0)
    swapped = torch.cat([x[:, 64:], x[:, :64]], dim=-1)
    with pytest.raises(AssertionError):
        assert_close(act_and_mul_triton(swapped, "silu"), act_and_mul_ref(x, "silu"))


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError):
        act_and_mul_triton(torch.zeros(1, 4), "relu")

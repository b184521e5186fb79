"""The fused QK-norm + rotary kernel against the torch reference: with per-head norms (Qwen3, Gemma 3's (1 + w)
form) and rotary only (Llama); head_dim 64/128/256, GQA head counts, 1/3/257 tokens (19 on CPU), random positions, q and k as
strided views of one merged QKV projection output."""

from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_cases import DEVICE_DTYPES, assert_close, gen, randn

pytest.importorskip("triton")

from pdserve.model.layers import RotaryEmbedding  # noqa: E402
from pdserve.ops.rotary import qk_norm_rope_ref, qk_norm_rope_triton  # noqa: E402


def _case(device, dtype, tokens, hq, hk, d, seed):
    g = gen(seed)
    qkv = randn((tokens, (hq + 2 * hk) * d), g, device, dtype, 2.0)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    rope = RotaryEmbedding(d, 10000.0 if d != 128 else 1e6, 4096).to(device)
    pos = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    return g, qkv, q, k, pos, rope


# The kernel runs one program per token, so a longer step adds programs, not paths: on CPU (Triton's interpreter)
# the 257-token case runs with 19 tokens, still neither 1 nor a power of two; on CUDA with 257.
CPU_MAX_TOKENS = 19


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 8, 2, 128), (3, 4, 1, 256), (257, 6, 2, 64), (5, 32, 8, 128)])
@pytest.mark.parametrize("norm", ["qwen3", "gemma3", "none"])
def test_qk_norm_rope(device, dtype, tokens, hq, hk, d, norm):
    if device == "cpu" and tokens > CPU_MAX_TOKENS:  # one program per token: 257 in the interpreter costs ~9 s a case
        tokens = CPU_MAX_TOKENS
    g, qkv, q, k, pos, rope = _case(device, dtype, tokens, hq, hk, d, tokens * 17 + hq + d)
    qw = kw = None
    offset = 0.0
    if norm != "none":
        qw = randn((d,), g, device, dtype, 0.3) + (1.0 if norm == "qwen3" else 0.0)
        kw = randn((d,), g, device, dtype, 0.3) + (1.0 if norm == "qwen3" else 0.0)
        offset = 1.0 if norm == "gemma3" else 0.0
    ref_q, ref_k = qk_norm_rope_ref(q, k, pos, rope.cos, rope.sin, qw, kw, 1e-6, offset)
    v_before = qkv[:, (hq + hk) * d :].clone()
    out_q, out_k = qk_norm_rope_triton(q, k, pos, rope.cos, rope.sin, qw, kw, 1e-6, offset)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(), "works in place"
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "v must stay untouched"


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
def test_positions_of_either_int_width(positions_dtype):
    _, _, q, k, pos, rope = _case("cpu", torch.float32, 9, 4, 2, 64, 1)
    ref_q, ref_k = qk_norm_rope_ref(q, k, pos, rope.cos, rope.sin)
    out_q, out_k = qk_norm_rope_triton(q, k, pos.to(positions_dtype), rope.cos, rope.sin)
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)


def test_wrong_positions_are_caught():
    _, _, q, k, pos, rope = _case("cpu", torch.float32, 6, 4, 2, 64, 2)
    ref_q, _ = qk_norm_rope_ref(q, k, pos, rope.cos, rope.sin)
    out_q, _ = qk_norm_rope_triton(q, k, (pos + 1) % 4096, rope.cos, rope.sin)
    with pytest.raises(AssertionError):
        assert_close(out_q, ref_q)

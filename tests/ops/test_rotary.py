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


# ---- the KV write folded into the rotary kernel (qk_norm_rope_triton(..., v=, kv=KVDest))

def _kv_case(dtype, kv_dtype, hk, d, bs, pad=None, seed=0):
    from tests.ops.attention_helpers import make_problem
    p = make_problem([21, 40, 3], [21, 7, 1], hq=2 * hk, hk=hk, d=d, bs=bs, dtype=dtype, kv_dtype=kv_dtype,
                     seed=seed, pad=pad)
    t = p.q.shape[0]
    g = gen(seed + 1)
    pos = torch.randint(0, 4096, (t,), generator=g).to(p.q.device)
    rope = RotaryEmbedding(d, 1e6, 4096).to(p.q.device)
    qw = randn((d,), g, str(p.q.device), dtype, 0.5).to(p.q.device)
    kw = randn((d,), g, str(p.q.device), dtype, 0.5).to(p.q.device)
    return p, pos, rope, qw, kw


def _check_rope_writes_kv(p, pos, rope, qw, kw):
    from pdserve.ops.attention.common import as_storage
    from pdserve.ops.attention.torch_ref import write_kv as write_kv_ref
    from pdserve.ops.rotary import KVDest
    ref_q, ref_k = qk_norm_rope_ref(p.q, p.k, pos, rope.cos, rope.sin, qw, kw, 1e-6)
    q, k = p.q.clone(), p.k.clone()
    pool = p.fresh_layer()
    before = pool.clone()
    qk_norm_rope_triton(q, k, pos, rope.cos, rope.sin, qw, kw, 1e-6, v=p.v,
                        kv=KVDest(pool, p.meta.slot_mapping, p.k_scale, p.v_scale))
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    expected = p.fresh_layer()
    write_kv_ref(expected, k, p.v, p.meta.slot_mapping, p.k_scale, p.v_scale)  # the write of the kernel's own keys
    assert not torch.equal(as_storage(expected), as_storage(before))
    assert torch.equal(as_storage(pool), as_storage(expected))  # every pool byte, written slots and the others


@pytest.mark.parametrize("hk,d,bs,dtype", [(2, 64, 16, torch.float32), (1, 128, 32, torch.float16),
                                           (3, 48, 16, torch.float16)])
def test_rope_writes_the_step_kv_as_write_kv_does(hk, d, bs, dtype):
    p, pos, rope, qw, kw = _kv_case(dtype, None, hk, d, bs, seed=d)
    _check_rope_writes_kv(p, pos, rope, qw, kw)


def test_rope_kv_write_skips_padded_tokens():
    p, pos, rope, qw, kw = _kv_case(torch.float16, None, 2, 32, 16, pad={"num_tokens": 40, "num_seqs": 4}, seed=3)
    assert (p.meta.slot_mapping[31:] == -1).all()
    _check_rope_writes_kv(p, pos, rope, qw, kw)


def test_rope_kv_write_refuses_a_pool_of_other_heads():
    from pdserve.ops.rotary import KVDest
    p, pos, rope, qw, kw = _kv_case(torch.float32, None, 2, 64, 16, seed=5)
    with pytest.raises(ValueError):
        qk_norm_rope_triton(p.q.clone(), p.k.clone(), pos, rope.cos, rope.sin, qw, kw, 1e-6, v=None,
                            kv=KVDest(p.fresh_layer(), p.meta.slot_mapping))
    with pytest.raises(ValueError):
        qk_norm_rope_triton(p.q.clone(), p.k.clone(), pos, rope.cos, rope.sin, qw, kw, 1e-6, v=p.v,
                            kv=KVDest(p.fresh_layer()[..., :32], p.meta.slot_mapping))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
                                            (torch.float16, torch.float8_e5m2)])
@pytest.mark.parametrize("hk,d,bs", [(8, 128, 16), (4, 256, 32), (1, 64, 16)])
def test_rope_writes_the_step_kv_cuda(dtype, kv_dtype, hk, d, bs):
    p, pos, rope, qw, kw = _kv_case(dtype, kv_dtype, hk, d, bs, pad={"num_tokens": 48, "num_seqs": 4}, seed=bs + d)
    _check_rope_writes_kv(p, pos, rope, qw, kw)

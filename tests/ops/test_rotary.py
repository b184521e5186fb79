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


# ---- the KV write folded into the kernel (pdserve.ops.attention.common.KVTarget): the key programs also store the
# rotated keys (exactly as returned) and the values at each token's slot, as write_kv would; skipped slots (< 0) and
# tokens past the slot mapping write nothing, and every other pool byte stays as it was.

from pdserve.ops.attention.common import KVTarget, as_storage  # noqa: E402
from pdserve.ops.attention.torch_ref import write_kv as write_kv_ref  # noqa: E402
from pdserve.ops.rotary import qk_norm_rope  # noqa: E402
from tests.ops.attention_helpers import gpu, make_problem  # noqa: E402


def _write_case(p, dtype, norm: bool, seed: int):
    g = gen(seed)
    d = p.q.shape[-1]
    rope = RotaryEmbedding(d, 1e6, 4096).to(p.q.device)
    pos = torch.randint(0, 4096, (p.q.shape[0],), generator=g).to(p.q.device)
    qw = kw = None
    if norm:
        qw = randn((d,), g, p.q.device, dtype, 0.3) + 1.0
        kw = randn((d,), g, p.q.device, dtype, 0.3) + 1.0
    ref_q, ref_k = qk_norm_rope_ref(p.q, p.k, pos, rope.cos, rope.sin, qw, kw, 1e-6)
    pool = p.fresh_layer()
    before = pool.clone()
    v = p.v.clone()
    out_q, out_k = qk_norm_rope_triton(p.q, p.k, pos, rope.cos, rope.sin, qw, kw, 1e-6, 0.0, v=v,
                                       kv=KVTarget(pool, p.meta.slot_mapping, p.k_scale, p.v_scale))
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)
    assert torch.equal(v, p.v), "v is read, never written"
    expect = before.clone()
    write_kv_ref(expect, out_k, v, p.meta.slot_mapping, p.k_scale, p.v_scale)
    assert not torch.equal(as_storage(expect), as_storage(before))
    assert torch.equal(as_storage(pool), as_storage(expect)), "the pool holds exactly the returned keys and the values"


@pytest.mark.parametrize("hk,d,bs,dtype,norm", [(2, 64, 16, torch.float32, True), (1, 128, 4, torch.float16, False),
                                                (3, 64, 8, torch.bfloat16, True)])
def test_kv_write_in_the_rotary_kernel_matches_write_kv(hk, d, bs, dtype, norm):
    p = make_problem([21, 9, 3], [5, 7, 1], hq=2 * hk, hk=hk, d=d, bs=bs, dtype=dtype, seed=d + hk)
    _write_case(p, dtype, norm, seed=bs)


def test_kv_write_skips_padded_rows_and_tokens_past_the_slots():
    p = make_problem([30, 5], [3, 1], hq=4, hk=2, d=32, bs=16, pad={"num_tokens": 8, "num_seqs": 4})
    assert (p.meta.slot_mapping[4:] == -1).all()
    _write_case(p, torch.float32, True, seed=3)
    short = make_problem([12, 7], [4, 2], hq=4, hk=2, d=32, bs=4, seed=5)
    short.meta.slot_mapping = short.meta.slot_mapping[:4]  # the last two tokens have no slot: nothing written
    _write_case(short, torch.float32, False, seed=4)


def test_a_wrong_slot_is_caught():
    p = make_problem([10], [2], hq=4, hk=2, d=32, bs=4, seed=7)
    pool, before = p.fresh_layer(), p.fresh_layer().clone()
    rope = RotaryEmbedding(32, 1e6, 64)
    pos = torch.tensor([8, 9])
    wrong = p.meta.slot_mapping.clone()
    wrong[0] = wrong[1]  # both tokens at one slot: the first token's slot keeps its old bytes
    _, k = qk_norm_rope_triton(p.q, p.k, pos, rope.cos, rope.sin, v=p.v, kv=KVTarget(pool, wrong))
    expect = before.clone()
    write_kv_ref(expect, k, p.v, p.meta.slot_mapping)
    assert not torch.equal(pool, expect)


def test_the_reference_path_writes_too():
    """On CPU (no fused kernel) qk_norm_rope with a target rotates with the reference and calls the torch write."""
    p = make_problem([9, 4], [2, 1], hq=4, hk=2, d=32, bs=4, seed=11)
    rope = RotaryEmbedding(32, 1e6, 64)
    pos = torch.tensor([7, 8, 3])
    pool = p.fresh_layer()
    expect = pool.clone()
    q, k = qk_norm_rope(p.q.clone(), p.k.clone(), pos, rope.cos, rope.sin, v=p.v,
                        kv=KVTarget(pool, p.meta.slot_mapping))
    ref_q, ref_k = qk_norm_rope_ref(p.q, p.k, pos, rope.cos, rope.sin)
    torch.testing.assert_close(k, ref_k)
    write_kv_ref(expect, ref_k, p.v, p.meta.slot_mapping)
    assert torch.equal(pool, expect)
    with pytest.raises(ValueError, match="needs v"):
        qk_norm_rope(p.q, p.k, pos, rope.cos, rope.sin, kv=KVTarget(pool, p.meta.slot_mapping))


@gpu
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
                                            (torch.float16, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fn)])
@pytest.mark.parametrize("hk,d,bs", [(8, 128, 16), (4, 256, 32), (1, 64, 16)])
def test_kv_write_in_the_rotary_kernel_cuda(dtype, kv_dtype, hk, d, bs):
    p = make_problem([900, 37, 1, 2048], [900, 1, 1, 512], hq=4 * hk, hk=hk, d=d, bs=bs, dtype=dtype,
                     kv_dtype=kv_dtype, seed=bs + d)
    _write_case(p, dtype, True, seed=d)

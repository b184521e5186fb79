"""The fused MoE kernels against their torch references, on fresh random inputs: moe_align (rows grouped by expert,
padded to the tile, on the device), the fused experts (grouped GEMMs, activation epilogue, routing weights, top-k
sum), the reference against transformers' own expert loop, the routing function, and the config tables.

On CPU the Triton kernels run in the interpreter (tiny shapes, fp32/fp16); the gpu-marked tests compile them for
real at Qwen3-30B-A3B's expert shapes for 8/64/128 experts, top-k 1/2/8, 1 to 4096 tokens, and replay a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.model.moe import softmax_topk
from pdserve.ops import fused_moe_config as fmc
from pdserve.ops import moe_align as moe_align_mod
from pdserve.ops.fused_moe import fused_moe, fused_moe_ref
from pdserve.ops.fused_moe_config import GemmTile, MoEKernelConfig, default_config, pick_bucket
from pdserve.ops.moe_align import max_rows, moe_align, moe_align_ref
from pdserve.ops.moe_route import route_topk

pytest.importorskip("triton")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _routing(T: int, E: int, K: int, device="cpu", gen=None):
    logits = torch.randn(T, E, generator=gen).to(device)
    return softmax_topk(logits, K, renormalize=True)


def _weights(E, H, inter, dtype, device="cpu", gen=None):
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) * inter**-0.5).to(device=device, dtype=dtype)
    return w13, w2


def _check_align(topk_ids: torch.Tensor, E: int, block_m: int, stable: bool = False):
    got = moe_align(topk_ids, E, block_m)
    ref = moe_align_ref(topk_ids, E, block_m)
    if stable:  # the one-program path sorts: the oracle's order exactly
        assert torch.equal(got.sorted_ids.cpu(), ref.sorted_ids.cpu())
    n_pairs = topk_ids.numel()
    assert got.sorted_ids.numel() == ref.sorted_ids.numel() == max_rows(n_pairs, E, block_m)
    n = int(ref.num_rows)
    assert int(got.num_rows) == n and n % block_m == 0
    assert torch.equal(got.expert_ids.cpu(), ref.expert_ids.cpu())
    g, r = got.sorted_ids.cpu(), ref.sorted_ids.cpu()
    expert_of_row = ref.expert_ids.cpu().repeat_interleave(block_m)[:n]
    for e in expert_of_row.unique().tolist():  # each expert's run holds the same rows (their order is free: atomics)
        run = expert_of_row == e
        assert torch.equal(g[:n][run].sort().values, r[:n][run].sort().values)
    assert (g[n:] == n_pairs).all()
    flat = topk_ids.reshape(-1).cpu().long()
    valid = g[:n][g[:n] < n_pairs].long()
    assert valid.sort().values.tolist() == list(range(n_pairs))  # every row exactly once
    blocks = torch.arange(n, dtype=torch.long) // block_m
    keep = g[:n] < n_pairs
    assert torch.equal(flat[g[:n][keep].long()], got.expert_ids.cpu()[blocks[keep]].long())  # in its expert's block


# ------------------------------------------------------------------ CPU: Triton interpreter, tiny shapes
@pytest.fixture(params=["one program", "three kernels"])
def align_path(request, monkeypatch):
    """moe_align's two paths: one program up to ONE_PROGRAM_PAIRS routed rows, three kernels above."""
    if request.param == "three kernels":
        monkeypatch.setattr(moe_align_mod, "ONE_PROGRAM_PAIRS", 0)
    return request.param


@pytest.mark.parametrize("T, K, E, block_m", [(1, 1, 8, 16), (1, 2, 8, 16), (5, 2, 8, 4), (37, 8, 64, 16),
                                             (100, 8, 128, 64), (64, 2, 8, 128), (16, 8, 128, 16), (3, 8, 60, 16)])
def test_moe_align_matches_reference(T, K, E, block_m, align_path):
    g = torch.Generator().manual_seed(T * 1000 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    _check_align(ids, E, block_m, stable=align_path == "one program")


def test_moe_align_skewed_routing(align_path):
    """Every token to the same few experts: long runs in some experts, none in the rest."""
    ids = torch.tensor([[3, 5]] * 40 + [[5, 0]] * 3, dtype=torch.int32)
    _check_align(ids, 8, 16, stable=align_path == "one program")


def test_moe_align_one_program_up_to_its_limit():
    """The largest routing one program takes (ONE_PROGRAM_PAIRS rows: 256 tokens at top-8 of 128 experts)."""
    T, K, E = moe_align_mod.ONE_PROGRAM_PAIRS // 8, 8, 128
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    _check_align(ids, E, 16, stable=True)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, K", [(1, 128, 8), (3, 8, 2), (5, 60, 8), (9, 16, 1), (4, 64, 6)])
def test_route_topk_matches_softmax_topk(T, E, K, dtype, renormalize):
    g = torch.Generator().manual_seed(T * 100 + E + K)
    logits = (torch.randn(T, E, generator=g) * 3).to(dtype)
    w, ids = route_topk(logits, K, renormalize)
    w_ref, ids_ref = softmax_topk(logits, K, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == ids.shape == (T, K)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


def test_route_topk_ties_strided_and_nan():
    # equal logits: the lower expert id first (torch.topk leaves the order of ties open)
    w, ids = route_topk(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), 2, True)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w, torch.tensor([[0.5, 0.5]]))
    # a column slice of a wider tensor (row stride != E)
    wide = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    w, ids = route_topk(wide[:, 4:12], 3, False)
    w_ref, ids_ref = softmax_topk(wide[:, 4:12], 3, False)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)
    # NaN logits: ids stay in range (the row grouping indexes by them) and other rows are untouched
    logits = torch.randn(3, 8)
    logits[1, 3] = float("nan")
    logits[2] = float("nan")
    w, ids = route_topk(logits, 2, True)
    w_ref, ids_ref = softmax_topk(logits[:1], 2, True)
    assert ((ids >= 0) & (ids < 8)).all() and torch.equal(ids[:1], ids_ref)
    torch.testing.assert_close(w[:1], w_ref)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 9, True)
    assert route_topk(torch.empty(0, 8), 2, True)[1].shape == (0, 2)


SMALL = [
    # T, K, E, H, I, activation, config (BLOCK_M, gate_up tile, down tile)
    (1, 2, 8, 32, 16, "silu", MoEKernelConfig(16, GemmTile(16, 16), GemmTile(16, 32))),
    (7, 2, 8, 48, 40, "silu", MoEKernelConfig(16, GemmTile(16, 32, 2), GemmTile(32, 16, 2))),  # ragged K and N tiles
    (20, 8, 16, 32, 32, "gelu_tanh", MoEKernelConfig(32, GemmTile(32, 16, 4), GemmTile(16, 32, 4))),
    (9, 1, 8, 32, 16, "silu", MoEKernelConfig(16, GemmTile(16, 16), GemmTile(16, 16))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, K, E, H, inter, act, cfg", SMALL)
def test_fused_moe_matches_reference_interpreted(T, K, E, H, inter, act, cfg, dtype):
    gen = torch.Generator().manual_seed(T + 100 * K + E)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13, w2 = _weights(E, H, inter, dtype, gen=gen)
    weights, ids = _routing(T, E, K, gen=gen)
    out = fused_moe(x, w13, w2, weights, ids, act, cfg)
    ref = fused_moe_ref(x, w13, w2, weights, ids, act)
    assert out.dtype == dtype and out.shape == (T, H)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, K, E, H, inter, act, cfg", SMALL)
def test_experts_rows_summed_by_the_next_norm(T, K, E, H, inter, act, cfg, dtype):
    """parts=True (model.moe.SUM_IN_NORM): the experts' weighted rows as PartialSums [K, T, H], which the add+RMSNorm
    after the layer sums in float32 and rounds once: what the norm of torch's sum over the experts gives, and
    total() is that sum. One expert a token (K = 1) stays a tensor."""
    from pdserve.ops.norm import final_rms_norm, fused_add_rms_norm
    from pdserve.ops.split_k import PartialSums

    gen = torch.Generator().manual_seed(T + 100 * K + E + 7)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13, w2 = _weights(E, H, inter, dtype, gen=gen)
    weights, ids = _routing(T, E, K, gen=gen)
    summed = fused_moe(x, w13, w2, weights, ids, act, cfg)
    left = fused_moe(x, w13, w2, weights, ids, act, cfg, parts=True)
    if K == 1:
        assert isinstance(left, torch.Tensor) and torch.equal(left, summed)
        return
    assert isinstance(left, PartialSums) and left.parts.shape == (K, T, H) and left.shape == (T, H)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(left.total(), summed, **tol)
    residual = torch.randn(T, H, generator=gen).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype)
    normed, res = fused_add_rms_norm(left, residual, norm_w, 1e-6)
    ref_normed, ref_res = fused_add_rms_norm(summed, residual, norm_w, 1e-6)
    torch.testing.assert_close(res, ref_res, **tol)
    torch.testing.assert_close(normed, ref_normed, **tol)
    rows = torch.tensor([T - 1])
    torch.testing.assert_close(final_rms_norm(left, residual, norm_w, 1e-6, rows=rows),
                               final_rms_norm(summed, residual, norm_w, 1e-6, rows=rows), **tol)


def test_fused_moe_rejects_bad_shapes():
    x = torch.randn(3, 32)
    w13, w2 = _weights(8, 32, 16, torch.float32)
    weights, ids = _routing(3, 8, 2)
    with pytest.raises(ValueError, match=r"\[E, 2I, H\]"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, weights, ids, "relu")
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe(x.half(), w13, w2, weights, ids)


@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_matches_transformers_experts(renormalize):
    """The oracle is transformers' Qwen3-MoE math: its router and its expert loop on the same weights."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
                                      norm_topk_prob=renormalize)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        x = torch.randn(11, 32)
        expect = block(x[None])[0]
        weights, ids = softmax_topk(torch.nn.functional.linear(x, block.gate.weight), 3, renormalize)
        got = fused_moe_ref(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) == renormalize


def test_routing_picks_the_largest_probabilities():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    w, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.dtype == torch.int32 and ids.tolist() == [[1, 3], [0, 3]]
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(w, torch.stack([p[0, [1, 3]], p[1, [0, 3]]]))
    w_norm, _ = softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w_norm, w / w.sum(-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 8, 64, 256, 512, 1024, 4096])
def test_default_configs_fit_shared_memory(T, dtype):
    cfg = default_config(128, 768, 2048, dtype, T, 8)
    elem = torch.empty((), dtype=dtype).element_size()
    assert fmc._tile_bytes(cfg.BLOCK_M, cfg.gate_up, 2, elem) <= fmc._SMEM_BUDGET
    assert fmc._tile_bytes(cfg.BLOCK_M, cfg.down, 1, elem) <= fmc._SMEM_BUDGET
    assert MoEKernelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_bucket_lookup():
    table = {b: default_config(128, 768, 2048, torch.bfloat16, b, 8) for b in (1, 16, 256, 4096)}
    assert pick_bucket(table, 1) is table[1]
    assert pick_bucket(table, 2) is table[16]
    assert pick_bucket(table, 256) is table[256]
    assert pick_bucket(table, 9000) is table[4096]


def test_get_config_reads_the_table_for_this_device(tmp_path, monkeypatch):
    tuned = {1: MoEKernelConfig(16, GemmTile(32, 256, 1, 4, 5), GemmTile(64, 256, 1, 4, 5)),
             512: MoEKernelConfig(64, GemmTile(128, 64, 16, 8, 4), GemmTile(256, 64, 16, 8, 4))}
    name = fmc.config_file_name(128, 768, 2048, torch.bfloat16, "Fake GPU 9000")
    assert name == "E=128,N=768,K=2048,dtype=bfloat16,device=Fake_GPU_9000.json"
    data = {"key": {"E": 128, "N": 768, "K": 2048, "dtype": "bfloat16", "device": "Fake GPU 9000"}, "top_k": 8,
            "configs": {str(k): v.to_dict() for k, v in tuned.items()}}
    (tmp_path / name).write_text(json.dumps(data))
    monkeypatch.setattr(fmc, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(fmc, "_device_name", lambda index: "Fake GPU 9000")
    dev = torch.device("cuda", 0)
    assert fmc.get_config(128, 768, 2048, torch.bfloat16, 1, 8, dev) == tuned[1]
    assert fmc.get_config(128, 768, 2048, torch.bfloat16, 300, 8, dev) == tuned[512]
    assert fmc.get_config(128, 768, 2048, torch.bfloat16, 9999, 8, dev) == tuned[512]
    # another top_k, dtype or shape: no table, the defaults
    assert fmc.get_config(128, 768, 2048, torch.bfloat16, 1, 2, dev) == default_config(128, 768, 2048, torch.bfloat16, 1, 2)
    assert fmc.get_config(128, 768, 2048, torch.float16, 1, 8, dev) == default_config(128, 768, 2048, torch.float16, 1, 8)
    assert fmc.get_config(64, 768, 2048, torch.bfloat16, 1, 8, dev) == default_config(64, 768, 2048, torch.bfloat16, 1, 8)


def test_shipped_tables_parse():
    for path in sorted(fmc.CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        key = data["key"]
        name = fmc.config_file_name(key["E"], key["N"], key["K"], getattr(torch, key["dtype"]), key["device"])
        assert path.name == name
        table = fmc.load_table(str(path))
        assert table and table.top_k == data["top_k"]
        assert all(c.BLOCK_M in (16, 32, 64, 128) for c in table.configs.values())


# ------------------------------------------------------------------ CUDA: compiled kernels, real shapes
QWEN3_30B = dict(H=2048, inter=768)
GPU_CASES = [(E, K, T) for E in (8, 64, 128) for K in (1, 2, 8) if K <= E for T in (1, 2, 7, 64, 255, 512, 1024, 4096)]


def _gpu_case(E, K, T, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, QWEN3_30B["H"], generator=gen).to("cuda", dtype)
    w13, w2 = _weights(E, QWEN3_30B["H"], QWEN3_30B["inter"], dtype, "cuda", gen)
    weights, ids = _routing(T, E, K, "cuda", gen)
    return x, w13, w2, weights, ids


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("E, K, T", GPU_CASES)
def test_moe_align_cuda(E, K, T):
    _, _, _, _, ids = _gpu_case(E, K, T, torch.bfloat16)
    for block_m in (16, 64, 128):
        _check_align(ids, E, block_m, stable=ids.numel() <= moe_align_mod.ONE_PROGRAM_PAIRS)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("E, K, T", [(128, 8, 1), (128, 8, 7), (128, 8, 256), (128, 8, 4096), (60, 4, 33),
                                     (8, 2, 100)])
def test_route_topk_cuda(E, K, T, dtype, renormalize):
    logits = (torch.randn(T, E, generator=torch.Generator().manual_seed(T + E)) * 2).to("cuda", dtype)
    w, ids = route_topk(logits, K, renormalize)
    w_ref, ids_ref = softmax_topk(logits, K, renormalize)
    # bf16/fp16 logits can tie; a tie's two experts may come in either order (torch.topk's is open)
    same = (ids == ids_ref).all(-1)
    tied = torch.gather(logits.float(), 1, ids.long()).eq(torch.gather(logits.float(), 1, ids_ref.long())).all(-1)
    assert (same | tied).all()
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("E, K, T", GPU_CASES)
def test_fused_moe_cuda_bf16(E, K, T):
    x, w13, w2, weights, ids = _gpu_case(E, K, T, torch.bfloat16)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("T", [1, 100, 2048])
def test_experts_rows_summed_by_the_next_norm_cuda(T):
    """parts=True on CUDA (Qwen3-30B-A3B's 128 experts, top-8, bf16): the add+RMSNorm of the rows against that of
    torch's sum over the experts, within one bf16 rounding."""
    from pdserve.ops.norm import fused_add_rms_norm

    x, w13, w2, weights, ids = _gpu_case(128, 8, T, torch.bfloat16)
    left = fused_moe(x, w13, w2, weights, ids, parts=True)
    summed = fused_moe(x, w13, w2, weights, ids)
    residual = torch.randn_like(summed)
    norm_w = torch.ones(summed.shape[1], dtype=summed.dtype, device=summed.device)
    a, ra = fused_add_rms_norm(left, residual, norm_w, 1e-6)
    b, rb = fused_add_rms_norm(summed, residual, norm_w, 1e-6)
    torch.testing.assert_close(ra.float(), rb.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 100, 2048])
def test_fused_moe_cuda_fp16_fp32(T, dtype):
    x, w13, w2, weights, ids = _gpu_case(128, 8, T, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.gpu
@CUDA
def test_fused_moe_has_no_host_sync_and_replays_in_a_cuda_graph():
    """Decode steps replay CUDA graphs: one capture must serve any routing, with no host sync inside."""
    T, E, K = 24, 128, 8
    x, w13, w2, weights, ids = _gpu_case(E, K, T, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in range(1, 4):
        nx, _, _, nw, nids = _gpu_case(E, K, T, torch.bfloat16, seed=seed)
        if seed == 3:  # skewed: every token to the same experts
            nids = torch.arange(K, dtype=torch.int32, device="cuda").repeat(T, 1)
        x.copy_(nx)
        weights.copy_(nw)
        ids.copy_(nids)
        graph.replay()
        torch.testing.assert_close(out.float(), fused_moe_ref(x, w13, w2, weights, ids).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@CUDA
def test_shipped_tables_for_this_device_are_correct():
    """Every tuned bucket of a table written for this GPU compiles and matches the reference."""
    name = torch.cuda.get_device_name().replace(" ", "_")
    paths = sorted(fmc.CONFIG_DIR.glob(f"*device={name}.json"))
    if not paths:
        pytest.skip(f"no tuned fused-MoE table for {name}")
    for path in paths:
        data = json.loads(path.read_text())
        key = data["key"]
        dtype = getattr(torch, key["dtype"])
        for bucket, d in data["configs"].items():
            T = int(bucket)
            gen = torch.Generator().manual_seed(T)
            x = torch.randn(T, key["K"], generator=gen).to("cuda", dtype)
            w13, w2 = _weights(key["E"], key["K"], key["N"], dtype, "cuda", gen)
            weights, ids = _routing(T, key["E"], data["top_k"], "cuda", gen)
            out = fused_moe(x, w13, w2, weights, ids, config=MoEKernelConfig.from_dict(d))
            torch.testing.assert_close(out.float(), fused_moe_ref(x, w13, w2, weights, ids).float(), atol=2e-2,
                                       rtol=2e-2, msg=f"{path.name} bucket {bucket}")

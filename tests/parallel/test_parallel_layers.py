"""The sharding math without processes: every rank's model is built in this process for a group whose collectives
are left to the test (the sum of the ranks' partial outputs is what an all-reduce would give), so shards, loading
by slices, vocabulary padding and dummy weights are checked against the unsharded model directly."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.loader import build_model, load_config, resolve_model
from pdserve.model.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_of,
    vocab_range,
)
from pdserve.parallel.group import TPGroup, tp_context
from pdserve.parallel.ranges import kv_head_range
from tests.engine.tiny_models import TINY


class DeferredGroup(TPGroup):
    """Rank `rank` of `size` whose collectives return this rank's part: the test sums or concatenates them."""

    def all_reduce(self, x):
        return x

    def gather_to_first(self, x):
        return x


def _build(path, tp: TPGroup, load_format: str = "safetensors"):
    cfg, source = load_config(resolve_model(str(path)))
    with tp_context(tp):
        return build_model(cfg, source, torch.device("cpu"), torch.float32, load_format, seed=3)


@pytest.fixture(scope="module")
def odd_vocab_llama(tmp_path_factory):
    """Tiny Llama with a vocabulary (251) that two ranks cannot split evenly: rank 1 holds a padding row."""
    import transformers

    kw = dict(TINY["llama"]["kw"], vocab_size=251)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float()
    out = tmp_path_factory.mktemp("odd_vocab") / "llama"
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_each_rank_loads_its_slices(arch, tiny_model_dirs):
    full = dict(_build(tiny_model_dirs[arch], TPGroup()).named_parameters())
    for rank in range(2):
        shard = _build(tiny_model_dirs[arch], DeferredGroup(rank, 2))
        for name, p in shard.named_parameters():
            spec = shard_of(p)
            if spec is None:
                torch.testing.assert_close(p, full[name], rtol=0, atol=0, msg=name)  # replicated (norms)
                continue
            want = full[name].narrow(spec.dim, spec.start, spec.length)
            torch.testing.assert_close(p.narrow(spec.dim, 0, spec.length), want, rtol=0, atol=0, msg=name)
        attn = shard.model.layers[0].self_attn
        # the merged QKV of this rank is its q, k, v rows stacked (one GEMM), viewed by the HF-named parameters
        assert attn.qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()
        assert attn.qkv_weight.shape[0] == attn.q_size + 2 * attn.kv_size


@pytest.mark.parametrize("num_kv_heads,size,expect", [
    (2, 2, [(0, 1), (1, 2)]),  # split
    (8, 2, [(0, 4), (4, 8)]),
    (1, 2, [(0, 1), (0, 1)]),  # replicated: Gemma 3 270M
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # each pair of ranks shares one
])
def test_kv_heads_split_or_replicated(num_kv_heads, size, expect):
    assert [kv_head_range(num_kv_heads, TPGroup(r, size)) for r in range(size)] == expect


def test_shapes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        kv_head_range(2, TPGroup(0, 3))
    with pytest.raises(ValueError, match="divisible"):
        kv_head_range(4, TPGroup(0, 3))


def test_gqa_groups_stay_on_one_rank():
    """With replicated KV heads, every query head of a rank uses that rank's KV head."""
    num_heads, num_kv = 8, 2
    for size in (2, 4, 8):
        for r in range(size):
            k0, k1 = kv_head_range(num_kv, TPGroup(r, size))
            per = num_heads // size
            group = num_heads // num_kv
            assert {h // group for h in range(r * per, (r + 1) * per)} == set(range(k0, k1))


def test_vocab_padding_sums_and_gathers_to_the_full_model(odd_vocab_llama):
    full = _build(odd_vocab_llama, TPGroup())
    ranks = [_build(odd_vocab_llama, DeferredGroup(r, 2)) for r in range(2)]
    assert [vocab_range(251, TPGroup(r, 2)) for r in range(2)] == [(0, 126, 126), (126, 251, 126)]
    assert float(ranks[1].model.embed_tokens.weight[-1].detach().abs().max()) == 0.0  # the padding row
    ids = torch.tensor([0, 5, 125, 126, 127, 250, 3])
    emb = sum(m.model.embed_tokens(ids) for m in ranks)
    torch.testing.assert_close(emb, full.model.embed_tokens(ids), rtol=0, atol=0)
    hidden = torch.randn(3, 64)
    parts = [m.lm_head(hidden) for m in ranks]
    assert all(p.shape == (3, 126) for p in parts)
    logits = torch.cat(parts, dim=-1)[:, :251]
    torch.testing.assert_close(logits, full.lm_head(hidden), rtol=1e-6, atol=1e-6)


def test_row_parallel_partial_sums_are_the_full_product():
    """Each rank multiplies its columns; all-reduced (here: summed by the test) plus the bias once is the full layer."""
    torch.manual_seed(0)
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    partial = 0
    for r in range(2):
        lin = RowParallelLinear(8, 5, True, 4 * r, 4 * r + 4, DeferredGroup(r, 2))
        assert shard_of(lin.weight).dim == 1 and lin.weight.shape == (5, 4)
        with torch.no_grad():
            lin.weight.copy_(w[:, 4 * r : 4 * r + 4])
            lin.bias.copy_(b)
            partial = partial + lin(x[:, 4 * r : 4 * r + 4]) - b  # forward = all_reduce(x W^T) + b
    torch.testing.assert_close(partial + b, torch.nn.functional.linear(x, w, b))


def test_row_parallel_parts_written_in_place_sum_once():
    """partial_into writes each part's product into rows of one output; finish reduces it once and adds the bias
    once: the same as the layer's forward on the whole input."""
    torch.manual_seed(0)
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(7, 8)
    total = 0
    for r in range(2):
        lin = RowParallelLinear(8, 5, True, 4 * r, 4 * r + 4, DeferredGroup(r, 2))
        with torch.no_grad():
            lin.weight.copy_(w[:, 4 * r : 4 * r + 4])
            lin.bias.copy_(b)
            out = torch.empty(7, 5)
            for s in (0, 3, 6):
                lin.partial_into(x[s : s + 3, 4 * r : 4 * r + 4], out[s : s + 3])
            total = total + lin.finish(out) - b
    torch.testing.assert_close(total + b, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_dummy_shards_are_slices_of_the_same_model(arch, tiny_model_dirs):
    """--load-format dummy: any TP size builds the same model (TP=2 vs TP=1 tests on dummy weights rely on it)."""
    full = dict(_build(tiny_model_dirs[arch], TPGroup(), "dummy").named_parameters())
    for rank in range(2):
        for name, p in _build(tiny_model_dirs[arch], DeferredGroup(rank, 2), "dummy").named_parameters():
            spec = shard_of(p)
            want = full[name] if spec is None else full[name].narrow(spec.dim, spec.start, spec.length)
            got = p if spec is None else p.narrow(spec.dim, 0, spec.length)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_size_one_layers_are_the_plain_ones():
    tp = TPGroup()
    with tp_context(tp):
        emb, head = VocabParallelEmbedding(10, 4), ParallelLMHead(4, 10)
    assert emb.weight.shape == (10, 4) and head.weight.shape == (10, 4)
    assert shard_of(emb.weight) is None and shard_of(head.weight) is None

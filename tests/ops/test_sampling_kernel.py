"""The sampling kernels (pdserve.ops.sampling): greedy rows equal torch's argmax (ties to the first index), sampled
rows follow softmax(logits / T) (chi-square over many rows of one distribution) and are exactly the inverse CDF of
their row's uniform (tl.rand(seed, row)), -inf tokens are never drawn, the seed picks the stream; the same checks of
the torch form where they apply. On CPU the kernels run in Triton's interpreter; on CUDA (marked gpu) compiled, at
Qwen3's vocabulary."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops.dispatch import force_fused
from pdserve.ops.sampling import sample_tokens

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOG2E = 1.4426950408889634


def _draw(logits, inv_temp, seed, fused, **launch):
    with force_fused(fused):
        return sample_tokens(logits.to(DEV), inv_temp.to(DEV), seed, **launch).cpu()


def _one_chunk(monkeypatch):
    """A row in one chunk (one program) unless a launch asks for more, whatever its width: one SM to fill."""
    from pdserve.ops import sampling

    monkeypatch.setattr(sampling, "_sm_count", lambda device: 1)
    monkeypatch.setattr(sampling, "MAX_CHUNK_STEPS", 64)


@pytest.fixture
def one_chunk(monkeypatch):
    _one_chunk(monkeypatch)


def _chi2(out: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the draws `out` against probabilities `p` (columns of p 0 must have no draw: inf)."""
    obs = torch.bincount(out, minlength=p.numel()).double()
    exp = p.double() * out.numel()
    if obs[exp == 0].sum() > 0:
        return float("inf")
    live = exp > 0
    return float(((obs[live] - exp[live]) ** 2 / exp[live]).sum())


# chi-square quantiles at 1 - 1e-4 (scipy.stats.chi2.ppf(0.9999, df)): a correct sampler fails 1 seed in 10,000
CHI2_9999 = {2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def _assert_follows(out: torch.Tensor, p: torch.Tensor) -> None:
    df = int((p > 0).sum()) - 1
    stat = _chi2(out, p)
    assert stat < CHI2_9999[df], (stat, torch.bincount(out, minlength=p.numel()), p * out.numel())


def test_the_chi_square_check_rejects_wrong_samplers():
    """The distribution check can fail: draws one column off, or at the untempered distribution, or on a -inf
    column are rejected (the exact draws of a correct sampler, from torch's generator, pass)."""
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, float("-inf"), 3.0, 0.0, 1.5])
    p = torch.softmax(logits / 0.7, -1)
    g = torch.Generator().manual_seed(0)
    good = torch.multinomial(p, 2000, replacement=True, generator=g)
    _assert_follows(good, p)
    assert _chi2(torch.where(good == 7, 0, good + 1), p) == float("inf")  # one column off: lands on the -inf one
    shifted = torch.where(good == 3, 5, torch.where(good == 5, 6, good))  # one column off, away from the -inf one
    assert _chi2(shifted, p) > CHI2_9999[6]
    untempered = torch.multinomial(torch.softmax(logits, -1), 2000, replacement=True, generator=g)
    assert _chi2(untempered, p) > CHI2_9999[6]


@pytest.mark.parametrize("chunks", ["split", "one"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_the_argmax_first_index_on_ties(fused, dtype, chunks, monkeypatch):
    if chunks == "one":
        _one_chunk(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((8, 4100), generator=g).to(dtype)  # past two of the kernel's 2048-column steps
    x[1, 7] = x[1, 4000] = 50.0  # a tie across steps: the first wins
    x[2, 2047] = x[2, 2048] = 50.0  # across the step boundary
    x[3, :] = 1.0  # all equal: token 0
    x[4, 4099] = float("inf")
    x[5, 600] = x[5, 300] = 50.0  # two lanes of one step
    x[6, 2148] = x[6, 1900] = 50.0  # the later column in a lower lane (2148 - 2048 = 100 < 1900): one chunk's lanes
    x[7, :] = float("-inf")  # all -inf: token 0, as torch
    out = _draw(x, torch.zeros(8), 1, fused)
    assert out.tolist() == x.argmax(-1).tolist()
    assert out.tolist()[1:4] + out.tolist()[5:] == [7, 2047, 0, 300, 1900, 0]


def test_one_chunk_fixture_gives_one_chunk(one_chunk):
    from pdserve.ops import sampling

    assert sampling.split_plan(8, 4100, sampling._sm_count(DEV))[0] == 1


@pytest.mark.parametrize("fused", [False, True])
def test_sampled_rows_follow_the_tempered_softmax(fused):
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, float("-inf"), 3.0, 0.0, 1.5])
    rows, temp = 1000, 0.7
    out = _draw(logits.repeat(rows, 1), torch.full((rows,), 1 / temp), 11, fused)
    assert (out != 4).all()  # a -inf token is never drawn
    _assert_follows(out, torch.softmax(logits / temp, -1))
    assert _chi2(out, torch.softmax(logits, -1)) > CHI2_9999[6]  # and not the untempered distribution


@triton.jit
def _uniforms_kernel(Out, seed, N, BLOCK: tl.constexpr):
    """The uniforms of the sampling kernel's rows: tl.rand(seed, row)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + rows, tl.rand(seed, rows), mask=rows < N)


def _inverse_cdf(logits: torch.Tensor, inv_temp: torch.Tensor, seed: int):
    """Each row's token by the inverse CDF at the kernel's uniform, in float64 from the kernel's float32 x (logit / T
    * log2(e)), and whether the uniform lies within 1e-5 of a boundary of the CDF (rounding may pick either side)."""
    rows = logits.shape[0]
    u = torch.empty(rows, dtype=torch.float32, device=DEV)
    with force_fused(True):
        _uniforms_kernel[(triton.cdiv(rows, 128),)](u, seed, rows, BLOCK=128)
    u = u.to(logits.device).double()
    x = (logits.float() * (inv_temp.to(logits.device).float() * LOG2E).unsqueeze(1)).double()
    p = torch.exp2(x - x.max(-1, keepdim=True).values)
    cdf = p.cumsum(-1) / p.sum(-1, keepdim=True)
    tok = (cdf <= u.unsqueeze(1)).sum(-1)
    near = ((cdf - u.unsqueeze(1)).abs() < 1e-5).any(-1)
    return tok, near


@pytest.mark.parametrize("launch", [{}, {"programs_per_sm": 1}, {"max_chunk_steps": 1}])
def test_each_row_takes_the_inverse_cdf_of_its_own_uniform(launch):
    """A sampled row's token is the first column whose CDF passes u = tl.rand(seed, row), whatever the split of the
    row into chunks (here 1 to 3 chunks of a 5000-token row, not a multiple of 2048: the last chunk is short) and
    whatever else the batch holds: off by one column, a wrong carry of the sum across the chunk's tiles or chunks, or
    another uniform would show. Row r keeps its uniform in a batch of other rows (the stream's counter r)."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 96, 5000
    x = torch.randn((rows, vocab), generator=g) * 2
    x[::3, :2100] = float("-inf")  # the first chunk without mass
    x[1::3, 2048:4100] -= 8  # little mass in the middle
    inv = torch.rand(rows, generator=g) * 1.5 + 0.25
    out = _draw(x, inv, 123, True, **launch)
    want, near = _inverse_cdf(x, inv, 123)
    assert near.sum() < rows // 4
    assert out[~near].tolist() == want[~near].tolist()
    assert len(set(out.tolist())) > rows // 2  # rows draw their own uniforms
    sub = _draw(x[:40], inv[:40], 123, True, **launch)  # the first rows of a smaller batch: the same draws
    assert sub[~near[:40]].tolist() == want[:40][~near[:40]].tolist()
    other = _draw(x, inv, 124, True, **launch)  # another seed, another stream
    assert (other != out).sum() > rows // 2


def test_rows_split_over_programs_sample_the_same_distribution(monkeypatch):
    """A row over several programs (here 16 columns a step, tiles of 8 in the second kernel: 40 tokens over 3
    programs) and the pick across their partials: the tempered softmax, greedy ties to the first index."""
    from pdserve.ops import sampling

    monkeypatch.setattr(sampling, "BLOCK", 16)
    monkeypatch.setattr(sampling, "TILE", 8)
    assert sampling.split_plan(200, 40, 132) == (3, 16) and sampling.split_plan(300, 40, 132) == (2, 32)
    assert sampling.split_plan(2, 40, 132) == (3, 16)
    logits = torch.full((40,), float("-inf"))
    logits[[3, 20, 29, 39]] = torch.tensor([0.0, 1.0, 0.5, 2.0])
    p = torch.softmax(logits, -1)
    rows = 600
    out = _draw(logits.repeat(rows, 1), torch.full((rows,), 1.0), 3, True)
    _assert_follows(out, p)
    two = _draw(logits.repeat(rows, 1), torch.full((rows,), 1.0), 3, True, programs_per_sm=1)  # 2 chunks of 32
    _assert_follows(two, p)
    tie = torch.zeros((2, 40))
    tie[0, [5, 17, 33]] = 9.0  # in each of the three programs: the first wins
    tie[1, [30, 38]] = 9.0
    assert _draw(tie, torch.zeros(2), 0, True).tolist() == [5, 30]


def test_split_plan_fills_the_sms_and_bounds_the_chunk():
    from pdserve.ops.sampling import BLOCK, MAX_CHUNK_STEPS, split_plan

    assert split_plan(1, 151936, 132) == (75, BLOCK)  # one row alone: every 2048-column step its own program
    for rows in (64, 256, 1024, 20000):  # chunks of at most MAX_CHUNK_STEPS steps: the second kernel reads one again
        s, chunk = split_plan(rows, 151936, 132)
        assert chunk % BLOCK == 0 and chunk <= MAX_CHUNK_STEPS * BLOCK and s * chunk >= 151936 > (s - 1) * chunk
    assert split_plan(256, 151936, 132) == (10, 8 * BLOCK)
    assert split_plan(256, 151936, 132, max_chunk_steps=4) == (19, 4 * BLOCK)
    assert split_plan(16, 151936, 132) == (25, 3 * BLOCK)  # ~4 programs an SM asked (33 a row): chunks of 3 steps
    assert split_plan(3, 5000, 132) == (3, BLOCK)
    assert split_plan(1, 2**24, 132)[0] == 128  # MAX_SPLITS: the second kernel's tile


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_and_sampled_rows_in_one_batch_and_the_seed(fused):
    g = torch.Generator().manual_seed(1)
    x = torch.randn((6, 300), generator=g)
    inv = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0, 0.0])
    a = _draw(x, inv, 5, fused)
    assert _draw(x, inv, 5, fused).tolist() == a.tolist()  # the same seed: the same draws
    greedy = x.argmax(-1)
    assert [a[i].item() for i in (0, 2, 5)] == [greedy[i].item() for i in (0, 2, 5)]
    draws = {tuple(_draw(x, inv, s, fused)[[1, 3, 4]].tolist()) for s in range(6)}
    assert len(draws) > 1  # other seeds, other draws


@pytest.mark.parametrize("fused", [False, True])
def test_mass_in_one_column_far_into_a_chunk(fused, one_chunk):
    """Nearly all of a row's mass on one column deep in its chunk (the second kernel's scan crosses a tile to reach
    it), in the short last chunk of a 5000-token row, and at the row's last column."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn((3, 5000), generator=g).to(torch.bfloat16)
    x[0, 3999] = x[1, 4500] = x[2, 4999] = 40.0
    for launch in ({}, {"programs_per_sm": 4}):
        out = _draw(x.repeat(20, 1), torch.ones(60), 9, fused, **launch)
        assert out.tolist() == [3999, 4500, 4999] * 20


@pytest.mark.parametrize("fused", [False, True])
def test_minus_inf_tokens_are_never_drawn(fused):
    """-inf columns (probability 0) around the live ones, a whole chunk of them, in rows that sample at several
    temperatures: never drawn; a row of nothing but -inf gives a token in range."""
    x = torch.full((5, 3000), float("-inf"))
    x[0, [2047, 2048]] = torch.tensor([0.0, 0.0])  # the two sides of a chunk boundary
    x[1, 2999] = 5.0  # one live token, the last one: the first chunk has no mass
    x[2, [0, 1, 1500]] = torch.tensor([1.0, -30.0, 2.0])
    x[3, 1::2] = torch.linspace(-3, 3, 1500)  # every other one
    rows = 100
    batch = x.repeat(rows, 1)
    inv = torch.tensor([1.0, 0.5, 3.0, 1.0, 1.0]).repeat(rows)
    out = _draw(batch, inv, 17, fused)
    assert (out < 3000).all() and (out >= 0).all()
    live = torch.isfinite(batch.gather(1, out.unsqueeze(1)).squeeze(1))
    assert live.view(rows, 5)[:, :4].all()  # the all -inf row (the last) has no live token
    assert set(out.view(rows, 5)[:, 1].tolist()) == {2999}
    assert set(out.view(rows, 5)[:, 0].tolist()) == {2047, 2048}


@pytest.mark.parametrize("fused", [False, True])
def test_vocabulary_not_a_multiple_of_2048(fused):
    """3000 tokens (a chunk of 2048 and a short one of 952): the tempered softmax, with mass in both chunks and on
    the last column."""
    logits = torch.full((3000,), float("-inf"))
    logits[[0, 1000, 2047, 2048, 2500, 2999]] = torch.tensor([0.5, 1.0, 0.0, 1.5, 2.0, 1.0])
    rows, temp = 1000, 1.3
    out = _draw(logits.repeat(rows, 1), torch.full((rows,), 1 / temp), 21, fused)
    _assert_follows(out, torch.softmax(logits / temp, -1))


@pytest.mark.parametrize("fused", [False, True])
def test_the_draw_lies_in_the_second_of_two_chunks(fused):
    """Two chunks (4096 tokens), with most of the mass in the second: the draws there follow it, and the first
    chunk's share too."""
    logits = torch.full((4096,), float("-inf"))
    logits[[10, 2000]] = torch.tensor([0.0, 0.5])
    logits[[2100, 3000, 4095]] = torch.tensor([2.0, 2.5, 1.0])
    rows = 1000
    out = _draw(logits.repeat(rows, 1), torch.ones(rows), 4, fused)
    _assert_follows(out, torch.softmax(logits, -1))
    assert (out >= 2048).float().mean() > 0.8


@pytest.mark.parametrize("fused", [False, True])
def test_very_low_temperatures_take_the_argmax(fused):
    """T = 1e-2 (the lowest that serving passes: SamplingParams raises lower ones) and far below: the largest logit,
    with a margin of 0.1 over the next (2^-14 of the mass at T = 1e-2)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn((16, 3000), generator=g)
    top = x.argmax(-1)
    x[torch.arange(16), top] += 0.1
    for inv in (100.0, 1e6, 1e12):
        out = _draw(x, torch.full((16,), inv), 8, fused)
        assert out.tolist() == top.tolist(), inv


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_qwen3_vocabulary_on_cuda():
    v = 151936
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn((256, v), generator=g, device="cuda").to(torch.bfloat16)
    assert torch.equal(sample_tokens(x, torch.zeros(256, device="cuda"), 3), x.argmax(-1))
    peaked = (x.float() * 4).to(torch.bfloat16)  # most of a row's mass on ~100 tokens: few uniforms near a boundary
    for rows in (256, 1):  # 10 chunks a row, and 75 for a row alone
        inv = torch.full((rows,), 1.0, device="cuda")
        out = sample_tokens(peaked[:rows], inv, 9)
        want, near = _inverse_cdf(peaked[:rows], inv, 9)
        assert near.sum() <= rows // 8 and torch.equal(out[~near], want[~near])
    small = torch.full((20000, 4), float("-inf"), device="cuda")
    small[:, :3] = torch.tensor([0.0, 1.0, 2.0], device="cuda")
    wide = torch.full((20000, v), float("-inf"), device="cuda", dtype=torch.bfloat16)
    wide[:, [10, 70000, v - 1]] = torch.tensor([0.0, 1.0, 2.0], device="cuda", dtype=torch.bfloat16)
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1)
    for logits, ids in ((small, [0, 1, 2]), (wide, [10, 70000, v - 1])):
        out = sample_tokens(logits, torch.ones(20000, device="cuda"), 4).cpu()
        freq = torch.tensor([(out == i).float().mean().item() for i in ids])
        assert freq.sum() == 1.0 and (freq - p).abs().max() < 0.015, freq
    one = torch.ones(1, device="cuda")  # one row alone: split over 75 programs
    out = torch.cat([sample_tokens(wide[:1], one, seed) for seed in range(6000)]).cpu()
    freq = torch.tensor([(out == i).float().mean().item() for i in [10, 70000, v - 1]])
    assert freq.sum() == 1.0 and (freq - p).abs().max() < 0.025, freq


def test_sampler_routes_plain_batches_to_the_kernel(monkeypatch):
    """pdserve.engine.sampler: a batch of greedy rows and plain temperature rows goes through the kernel (under
    force_fused on CPU: the interpreter) with 1/T per row and 0 for greedy; greedy rows get the argmax; a batch with a
    filter, a seed or logprobs keeps the torch path; an all-greedy batch keeps torch's argmax."""
    from pdserve.engine import sampler as S
    from pdserve.engine.request import Request
    from pdserve.sampling_params import SamplingParams

    calls = []
    real = S.sample_tokens
    dev = DEV

    def spy(logits, inv_temp, seed):
        calls.append(inv_temp.tolist())
        return real(logits, inv_temp, seed)

    monkeypatch.setattr(S, "sample_tokens", spy)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn((4, 64), generator=g).to(torch.bfloat16).to(dev)

    def reqs(*params):
        return [Request(f"r{i}", [1, 2], SamplingParams(**p), frozenset()) for i, p in enumerate(params)]

    plain = reqs({"temperature": 0.0}, {}, {"temperature": 0.5}, {"temperature": 0.0})
    with force_fused(True):
        out = S.sample_async(logits, plain).result().token_ids
    assert calls == [[0.0, 1.0, 2.0, 0.0]]
    assert [out[0], out[3]] == [logits[0].argmax().item(), logits[3].argmax().item()]
    assert all(0 <= t < 64 for t in out)
    for other in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 3}, {"logprobs": 1},
                  {"presence_penalty": 0.5}):
        batch = reqs({}, other)
        for r in batch:
            r.generator = torch.Generator(device=dev).manual_seed(3) if r.params.seed is not None else None
        with force_fused(True):
            S.sample_async(logits[:2].float(), batch).result()
    with force_fused(True):
        greedy = S.sample_async(logits, reqs(*[{"temperature": 0.0}] * 4)).result().token_ids
    assert greedy == logits.argmax(-1).tolist()
    assert len(calls) == 1  # only the plain batch took the kernel
    if dev.type == "cpu":
        with force_fused(False):
            S.sample_async(logits, plain).result()  # CPU: the torch path
        assert len(calls) == 1

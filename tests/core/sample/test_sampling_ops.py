"""Reference sampling ops: each against an independent statement of what it must compute."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops import OpTable, op_defs
from deepinfer.ops.sampling import mix32, uniform_noise
from deepinfer.testing import samples
from tests.support.engine_checks import chi_square_p

SAMPLING_OPS = ["apply_penalties", "filter_logits", "sample_tokens", "token_logprobs"]


@pytest.fixture(scope="module")
def ops():
    return OpTable()


@pytest.mark.parametrize("name", SAMPLING_OPS)
def test_registered_with_docstring_and_runnable_samples(name):
    op = op_defs()[name]
    assert op.reference.__doc__ and "[N" in op.reference.__doc__
    cases = samples(op, torch.float32)
    assert cases
    for case in cases:
        op.reference(*case.args, **case.kwargs)


def test_mix32_is_a_32_bit_bijection_sample():
    x = torch.arange(0, 1 << 16, dtype=torch.int64) * 65537
    h = mix32(x)
    assert int(h.min()) >= 0 and int(h.max()) < 1 << 32
    assert h.unique().numel() == x.numel()
    # Avalanche: flipping one input bit flips about half the output bits.
    flipped = mix32(x ^ 1)
    bits = sum(int(((h ^ flipped) >> b & 1).sum()) for b in range(32)) / (32 * x.numel())
    assert 0.45 < bits < 0.55


def test_noise_depends_only_on_seed_step_token():
    seeds = torch.tensor([3, 3, 4, -5], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    u = uniform_noise(seeds, steps, 64)
    assert ((u > 0) & (u < 1)).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    alone = uniform_noise(seeds[3:], steps[3:], 64)
    assert torch.equal(alone[0], u[3])  # no dependence on the other rows
    assert torch.equal(uniform_noise(seeds, steps, 64), u)  # stateless


def test_sampling_matches_softmax_chi_square(ops):
    """At temperature 1 the draws follow softmax(logits) (8 tokens, 6000 draws keyed by step)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    draws = 6000
    rows = logits.expand(draws, -1).contiguous()
    tokens = ops.sample_tokens(rows, torch.zeros(draws, dtype=torch.bool), torch.full((draws,), 1234),
                               torch.arange(draws))
    counts = torch.bincount(tokens, minlength=8).double()
    assert chi_square_p(counts, torch.softmax(logits[0].double(), -1)) > 1e-3
    # A wrong distribution is rejected by the same test (it has power).
    assert chi_square_p(counts, torch.softmax(0.8 * logits[0].double(), -1)) < 1e-3


def test_sampling_respects_excluded_tokens_and_greedy(ops):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 10:] = float("-inf")
    greedy = torch.tensor([True, False, True, False])
    tokens = ops.sample_tokens(logits, greedy, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert (tokens < 10).all()
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_sampling_is_row_independent(ops):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    seeds, steps = torch.arange(6) * 77, torch.arange(6)
    greedy = torch.zeros(6, dtype=torch.bool)
    together = ops.sample_tokens(logits, greedy, seeds, steps)
    for i in range(6):
        assert ops.sample_tokens(logits[i:i + 1], greedy[i:i + 1], seeds[i:i + 1], steps[i:i + 1]) == together[i]


def _filter(ops, logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return ops.filter_logits(logits[None], torch.tensor([temperature]), torch.tensor([top_k]),
                             torch.tensor([top_p]), torch.tensor([min_p]))[0]


def test_filter_top_k_top_p_min_p_temperature(ops):
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, -1.0, 2.5])
    kept = lambda x: set(torch.isfinite(x).nonzero().flatten().tolist())  # noqa: E731
    assert kept(_filter(ops, logits, top_k=2)) == {0, 5}
    assert kept(_filter(ops, logits, top_k=100)) == set(range(6))
    probs = torch.softmax(logits, -1)
    # top_p: the smallest most-likely set whose mass reaches p.
    order = probs.argsort(descending=True).tolist()
    for p in (0.3, 0.6, 0.8, 0.95):
        mass, expected = 0.0, set()
        for t in order:
            expected.add(t)
            mass += probs[t].item()
            if mass >= p:
                break
        assert kept(_filter(ops, logits, top_p=p)) == expected, p
    # min_p: tokens below min_p * max probability go.
    expected = {t for t in range(6) if probs[t] >= 0.2 * probs.max()}
    assert kept(_filter(ops, logits, min_p=0.2)) == expected
    # temperature scales the surviving logits.
    torch.testing.assert_close(_filter(ops, logits, temperature=0.5), logits / 0.5)
    # greedy rows (temperature 0) are left unscaled.
    torch.testing.assert_close(_filter(ops, logits, temperature=0.0), logits)


def test_penalties_follow_the_openai_formula(ops):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt_mask = torch.tensor([[True, False, False, False, True]])
    counts = torch.tensor([[0, 2, 1, 0, 0]], dtype=torch.int32)
    out = ops.apply_penalties(logits, prompt_mask, counts, torch.tensor([0.5]), torch.tensor([0.25]),
                              torch.tensor([2.0]))
    expected = []
    for t, x in enumerate(logits[0].tolist()):
        seen = bool(prompt_mask[0, t]) or counts[0, t] > 0
        if seen:
            x = x / 2.0 if x > 0 else x * 2.0
        x -= 0.25 * int(counts[0, t]) + 0.5 * (counts[0, t] > 0)
        expected.append(x)
    torch.testing.assert_close(out[0], torch.tensor(expected))


def test_token_logprobs_rank_and_top(ops):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    tokens = torch.tensor([0, 5, 39])
    lp, rank, top_ids, top_lp = ops.token_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits.double(), -1)
    for i in range(3):
        assert math.isclose(lp[i].item(), ref[i, tokens[i]].item(), abs_tol=1e-6)
        assert rank[i].item() == 1 + int((ref[i] > ref[i, tokens[i]]).sum())
        assert top_ids[i].tolist() == ref[i].argsort(descending=True)[:4].tolist()
        torch.testing.assert_close(top_lp[i].double(), ref[i, top_ids[i]], atol=1e-6, rtol=0)
    _, _, none_ids, none_lp = ops.token_logprobs(logits, tokens, 0)
    assert none_ids.shape == (3, 0) and none_lp.shape == (3, 0)


def test_sample_tokens_comparison_tolerates_only_near_ties():
    """The conformance check for sample_tokens accepts a flip only where the race was a near-tie."""
    op = op_defs()["sample_tokens"]
    (case,) = samples(op, torch.float32)
    expected = op.reference(*case.args)
    op.compare(expected.clone(), expected, case, torch.float32)
    wrong = expected.clone()
    wrong[0] = (wrong[0] + 1) % case.args[0].shape[-1]
    with pytest.raises(AssertionError, match="row 0"):
        op.compare(wrong, expected, case, torch.float32)


def test_temperature_only_rows_skip_truncation_and_ignore_their_neighbours():
    """Rows without top-k / top-p / min-p are only scaled (no full-vocabulary sort, no tail cut), and a row's
    draw does not depend on whether the rows beside it truncate."""
    from deepinfer.ops import OpTable
    from deepinfer.sample.sampler import Sampler, SamplingRow
    from deepinfer.sampling_params import SamplingParams

    calls = []
    table = OpTable()
    real = table.filter_logits

    def counting_filter(logits, *args):
        calls.append(logits.shape[0])
        return real(logits, *args)

    table.filter_logits = counting_filter  # ops are instance attributes of the table
    sampler = Sampler(table)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=gen) * 3
    plain, nucleus = SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_p=0.5, top_k=20)

    def rows(params):
        return [SamplingRow(p, seed=11 + i, step=4, prompt_ids=[1], output_ids=[]) for i, p in enumerate(params)]

    alone = sampler(logits, rows([plain, plain, plain]))
    assert calls == []  # nobody truncates: the filter op never runs
    mixed = sampler(logits, rows([plain, nucleus, plain]))
    assert calls == [1]  # only the truncating row goes through it
    assert mixed[0] == alone[0] and mixed[2] == alone[2]
    # Temperature-only draws reach the far tail: over many seeds, tokens outside the top 50 % mass appear.
    flat = torch.zeros(1, 300)
    flat[0, :5] = 4.0
    seen = {int(sampler(flat, [SamplingRow(plain, seed=s, step=0, prompt_ids=[1], output_ids=[])])[0])
            for s in range(200)}
    assert any(t >= 5 for t in seen)


def test_penalties_count_the_token_in_flight():
    """A row whose last token is still on the device (async scheduling) is penalised for it as if it were
    in ``output_ids``."""
    from deepinfer.ops import OpTable
    from deepinfer.sample.sampler import Sampler, SamplingRow
    from deepinfer.sampling_params import SamplingParams

    sampler = Sampler(OpTable())
    logits = torch.zeros(2, 50)
    logits[:, 7], logits[:, 9] = 5.0, 4.0  # token 7 wins unless it is penalised
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    counted = [SamplingRow(params, 0, 3, [1], [7]) for _ in range(2)]  # token 7 already read by the host
    in_flight = [SamplingRow(params, 0, 3, [1], []) for _ in range(2)]  # ... or still on the device (row 1)
    assert sampler(logits, counted).tolist() == [9, 9]
    assert sampler(logits, in_flight).tolist() == [7, 7]
    assert sampler(logits, in_flight, inflight=(torch.tensor([1]), torch.tensor([7]))).tolist() == [7, 9]

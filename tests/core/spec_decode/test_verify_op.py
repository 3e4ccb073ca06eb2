"""verify_drafts on toy logits: greedy acceptance, and the rejection sampler's output distribution equals the
target's (chi-square over the first two generated tokens of a Markov-chain target, many seeds at once)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.sampling import sample_tokens
from deepinfer.ops.speculative import verify_drafts
from tests.support.engine_checks import chi_square_p

V, K = 6, 3


def test_greedy_accepts_the_matching_prefix_then_takes_the_argmax():
    target = torch.full((2, K + 1, V), -5.0)
    for j, t in enumerate([2, 4, 1, 5]):
        target[:, j, t] = 5.0
    drafts = torch.tensor([[2, 4, 0], [2, 4, 1]])
    out, acc = verify_drafts(target, torch.tensor([True, True]), drafts, None, torch.tensor([3, 2]),
                             torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert acc.tolist() == [2, 2]
    assert out.tolist() == [[2, 4, 1, -1], [2, 4, 1, -1]]  # row 1 verified 2 drafts: its third row is the bonus
    out, acc = verify_drafts(target, torch.tensor([True, True]), drafts, None, torch.tensor([0, 3]),
                             torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert acc.tolist() == [0, 3] and out.tolist() == [[2, -1, -1, -1], [2, 4, 1, 5]]


def test_a_bonus_token_is_the_plain_sampled_token():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(5, K + 1, V, generator=gen)
    seeds, steps = torch.arange(5), torch.arange(5) * 3
    out, acc = verify_drafts(target, torch.zeros(5, dtype=torch.bool), torch.zeros(5, K, dtype=torch.int64), None,
                             torch.zeros(5, dtype=torch.int64), seeds, steps)
    assert acc.tolist() == [0] * 5
    plain = sample_tokens(target[:, 0], torch.zeros(5, dtype=torch.bool), seeds, steps)
    assert out[:, 0].tolist() == plain.tolist()


def _chain(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * scale


def _generate(a: torch.Tensor, b: torch.Tensor | None, n: int, length: int) -> torch.Tensor:
    """``n`` independent continuations of token 0 under target chain ``a`` with drafts from chain ``b`` (None: a
    greedy drafter proposing the argmax of a third chain), K drafts a step, seeds 0..n-1."""
    gen = torch.Generator().manual_seed(1)
    out = torch.full((n, length), -1, dtype=torch.int64)
    have = torch.zeros(n, dtype=torch.int64)
    last = torch.zeros(n, dtype=torch.int64)
    seeds = torch.arange(n, dtype=torch.int64)
    greedy_chain = _chain(99, 1.0)
    while bool((have < length).any()):
        drafts = torch.empty(n, K, dtype=torch.int64)
        q = torch.empty(n, K, V)
        prev = last
        for j in range(K):
            if b is None:
                drafts[:, j] = greedy_chain[prev].argmax(-1)
            else:
                q[:, j] = torch.softmax(b[prev], -1)
                drafts[:, j] = torch.multinomial(q[:, j], 1, generator=gen)[:, 0]
            prev = drafts[:, j]
        inputs = torch.cat([last[:, None], drafts], dim=1)  # row j sees the anchor and drafts < j
        target = a[inputs]
        num = torch.full((n,), K, dtype=torch.int64)
        tokens, acc = verify_drafts(target, torch.zeros(n, dtype=torch.bool), drafts, None if b is None else q,
                                    num, seeds, have)
        for i in range(n):
            emitted = tokens[i, : acc[i] + 1].tolist()
            h = int(have[i])
            take = emitted[: max(0, length - h)]
            out[i, h : h + len(take)] = torch.tensor(take, dtype=torch.int64)
            have[i] = h + len(emitted)
            last[i] = emitted[-1]
    return out


@pytest.mark.parametrize("drafter", ["sampled", "greedy"])
def test_rejection_sampling_reproduces_the_target_distribution(drafter):
    a = _chain(3, 1.5)
    b = _chain(4, 1.5) if drafter == "sampled" else None
    out = _generate(a, b, n=6000, length=2)
    p = torch.softmax(a, -1)
    joint = p[0][:, None] * p  # P(x1, x2 | x0 = 0)
    counts = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V)
    assert chi_square_p(counts, joint.flatten()) > 1e-3
    # Negative control: the drafter's own chain is visibly different.
    if b is not None:
        q = torch.softmax(b, -1)
        assert chi_square_p(counts, (q[0][:, None] * q).flatten()) < 1e-6


def test_compare_forgives_only_near_ties():
    """The op's compare (used against backend kernels): a sampled decision flipped within 1e-4 of its threshold
    passes, one flipped 1% away fails, and so does any change to a greedy request."""
    from deepinfer.ops.registry import OpSample
    from deepinfer.ops.sampling import uniform_noise
    from deepinfer.ops.speculative import ACCEPT_SALT, _compare_verified, _draft_tests, _own_scores

    gen = torch.Generator().manual_seed(5)
    target = torch.randn(2, K + 1, V, generator=gen)
    greedy = torch.tensor([False, True])
    drafts = target[:, :K].argmax(-1)
    seeds, steps, num = torch.tensor([11, 12]), torch.tensor([40, 41]), torch.tensor([K, K])

    def sample_with(scale: float) -> OpSample:
        """Request 0's first draft q(x) = scale * p(x) / u: rejected for scale > 1 (near-tie for ~1)."""
        q = torch.full((2, K, V), 1.0 / V)
        p_x = torch.softmax(target[0, 0], -1)[drafts[0, 0]]
        u = uniform_noise(seeds[:1], (steps[:1]) ^ ACCEPT_SALT, 1)[0, 0]
        q[0, 0, drafts[0, 0]] = float(p_x / u * scale)
        return OpSample((target, greedy, drafts, q, num, seeds, steps))

    def accepting_one_more(sample: OpSample) -> tuple[torch.Tensor, torch.Tensor]:
        """What a kernel that accepted request 0's first draft would return."""
        tokens, accepted = verify_drafts(*sample.args)
        assert int(accepted[0]) == 0
        ok, _ = _draft_tests(*sample.args)
        ok[0, 0] = True
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
        a = int(accepted[0])
        tokens = tokens.clone()
        tokens[0] = -1
        tokens[0, :a] = drafts[0, :a]
        tokens[0, a] = _own_scores(*sample.args, accepted)[0].argmax()
        return tokens, accepted

    near = sample_with(1.0 + 1e-6)
    _compare_verified(accepting_one_more(near), verify_drafts(*near.args), near, torch.float32)
    far = sample_with(1.01)
    with pytest.raises(AssertionError, match="decided against its test"):
        _compare_verified(accepting_one_more(far), verify_drafts(*far.args), far, torch.float32)
    tokens, accepted = verify_drafts(*near.args)
    changed = tokens.clone()
    changed[1, int(accepted[1])] = (changed[1, int(accepted[1])] + 1) % V
    with pytest.raises(AssertionError, match="greedy"):
        _compare_verified((changed, accepted), (tokens, accepted), near, torch.float32)

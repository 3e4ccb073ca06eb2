"""verify_drafts on toy logits: greedy acceptance; every emitted token is plain sampling's token at its position
whatever the drafts; the output distribution is the target's (chi-square over the first two generated tokens of a
Markov-chain target, many seeds at once); a drafter racing the same noise is accepted at the coupling's rate."""

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
    out, acc = verify_drafts(target, torch.tensor([True, True]), drafts, torch.tensor([3, 2]),
                             torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert acc.tolist() == [2, 2]
    assert out.tolist() == [[2, 4, 1, -1], [2, 4, 1, -1]]  # row 1 verified 2 drafts: its third row is the bonus
    out, acc = verify_drafts(target, torch.tensor([True, True]), drafts, torch.tensor([0, 3]),
                             torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert acc.tolist() == [0, 3] and out.tolist() == [[2, -1, -1, -1], [2, 4, 1, 5]]


@pytest.mark.parametrize("drafts_from", ["random", "plain tokens", "negative"])
def test_every_emitted_token_is_the_plain_token_at_its_position(drafts_from):
    """Whatever the drafts, row j's emitted token is ``sample_tokens`` of row j at output position step + j (greedy
    rows: the argmax); the drafts decide only how many rows a step emits."""
    gen = torch.Generator().manual_seed(0)
    b, v = 64, 4  # a small vocabulary: random drafts agree often enough to be accepted
    target = torch.randn(b, K + 1, v, generator=gen) * 2
    greedy = torch.arange(b) % 4 == 0
    seeds = torch.randint(-2**62, 2**62, (b,), generator=gen)
    steps = torch.randint(0, 1000, (b,), generator=gen)
    at = steps[:, None] + torch.arange(K + 1)
    plain = sample_tokens(target.reshape(-1, v), greedy.repeat_interleave(K + 1), seeds.repeat_interleave(K + 1),
                          at.flatten()).view(b, K + 1)
    drafts = {"random": torch.randint(0, v, (b, K), generator=gen), "plain tokens": plain[:, :K].clone(),
              "negative": torch.full((b, K), -1)}[drafts_from]
    num = torch.arange(b) % (K + 1)
    tokens, accepted = verify_drafts(target, greedy, drafts, num, seeds, steps)
    emitted = torch.arange(K + 1)[None, :] <= accepted[:, None]
    assert torch.equal(tokens[emitted], plain[emitted])
    assert bool((tokens[~emitted] == -1).all())
    assert torch.equal(tokens[:, :K][emitted[:, :K] & (torch.arange(K) < accepted[:, None])],
                       drafts[emitted[:, :K] & (torch.arange(K) < accepted[:, None])])
    expected = {"random": None, "plain tokens": num, "negative": torch.zeros(b, dtype=torch.int64)}[drafts_from]
    if expected is not None:
        assert torch.equal(accepted, expected)
    else:
        assert 0 < int(accepted.sum()) < int(num.sum())  # both outcomes occur


def _chain(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * scale


def _race_drafts(chain: torch.Tensor, last: torch.Tensor, seeds: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """K drafts from ``chain`` raced with the verifier's noise of (seed, at + j): a coupled sampled drafter."""
    drafts, prev = torch.empty(len(last), K, dtype=torch.int64), last
    for j in range(K):
        prev = drafts[:, j] = sample_tokens(chain[prev], torch.zeros(len(last), dtype=torch.bool), seeds, at + j)
    return drafts


def _generate(a: torch.Tensor, b: torch.Tensor | None, n: int, length: int) -> tuple[torch.Tensor, float]:
    """``n`` independent continuations of token 0 under target chain ``a`` with drafts from chain ``b`` (raced
    with the verifier's noise; None: a greedy drafter proposing the argmax of a third chain), K drafts a step,
    seeds 0..n-1; and the fraction of verified drafts accepted."""
    out = torch.full((n, length), -1, dtype=torch.int64)
    have = torch.zeros(n, dtype=torch.int64)
    last = torch.zeros(n, dtype=torch.int64)
    seeds = torch.arange(n, dtype=torch.int64)
    greedy_chain = _chain(99, 1.0)
    verified = accepted_total = 0
    while bool((have < length).any()):
        if b is None:
            drafts, prev = torch.empty(n, K, dtype=torch.int64), last
            for j in range(K):
                prev = drafts[:, j] = greedy_chain[prev].argmax(-1)
        else:
            drafts = _race_drafts(b, last, seeds, have)
        inputs = torch.cat([last[:, None], drafts], dim=1)  # row j sees the anchor and drafts < j
        num = torch.full((n,), K, dtype=torch.int64)
        tokens, acc = verify_drafts(a[inputs], torch.zeros(n, dtype=torch.bool), drafts, num, seeds, have)
        verified, accepted_total = verified + n * K, accepted_total + int(acc.sum())
        for i in range(n):
            emitted = tokens[i, : acc[i] + 1].tolist()
            h = int(have[i])
            take = emitted[: max(0, length - h)]
            out[i, h : h + len(take)] = torch.tensor(take, dtype=torch.int64)
            have[i] = h + len(emitted)
            last[i] = emitted[-1]
    return out, accepted_total / verified


@pytest.mark.parametrize("drafter", ["sampled", "greedy"])
def test_coupled_verification_reproduces_the_target_distribution(drafter):
    a = _chain(3, 1.5)
    b = _chain(4, 1.5) if drafter == "sampled" else None
    out, _ = _generate(a, b, n=6000, length=2)
    p = torch.softmax(a, -1)
    joint = p[0][:, None] * p  # P(x1, x2 | x0 = 0)
    counts = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V)
    assert chi_square_p(counts, joint.flatten()) > 1e-3
    # Negative control: the drafter's own chain is visibly different.
    if b is not None:
        q = torch.softmax(b, -1)
        assert chi_square_p(counts, (q[0][:, None] * q).flatten()) < 1e-6


def test_a_drafter_racing_the_same_noise_is_accepted_at_the_coupling_rate():
    """First drafts of chain b against chain a from token 0: raced with the verifier's noise they are accepted with
    probability >= (1 - TV) / (1 + TV); raced with other noise (an independent drafter), at sum_t p_t q_t only."""
    a, b = _chain(3, 1.5), _chain(5, 0.5) + _chain(3, 1.5)  # a drafter close to the target
    n = 8000
    seeds, zero = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    target = a[torch.zeros(n, 2, dtype=torch.int64)]
    p, q = torch.softmax(a[0], -1), torch.softmax(b[0], -1)
    tv = float((p - q).abs().sum() / 2)

    def first_accepted(steps: torch.Tensor) -> float:
        drafts = sample_tokens(b[zero], torch.zeros(n, dtype=torch.bool), seeds, steps)[:, None]
        _, acc = verify_drafts(target, torch.zeros(n, dtype=torch.bool), drafts, torch.ones(n, dtype=torch.int64),
                               seeds, zero)
        return float(acc.double().mean())

    coupled, independent = first_accepted(zero), first_accepted(zero + 10_000)
    slack = 3 * (0.25 / n) ** 0.5
    assert coupled >= (1 - tv) / (1 + tv) - slack, (coupled, tv)
    assert abs(independent - float((p * q).sum())) < slack, (independent, float((p * q).sum()))
    assert coupled > independent + 0.1


def test_compare_forgives_only_near_ties():
    """The op's compare (used against backend kernels): a sampled token flipped to a race score within 1e-4 of the
    winner's passes, one 1e-2 away fails, and so does any change to a greedy request."""
    from deepinfer.ops.registry import OpSample
    from deepinfer.ops.sampling import _race_scores
    from deepinfer.ops.speculative import _compare_verified

    gen = torch.Generator().manual_seed(5)
    greedy = torch.tensor([False, True])
    seeds, steps, num = torch.tensor([11, 12]), torch.tensor([40, 41]), torch.tensor([0, K])

    def flipped(gap: float) -> tuple[OpSample, tuple[torch.Tensor, torch.Tensor]]:
        """A sample whose request 0 (no drafts) has its runner-up ``gap`` behind the winner, and what a kernel that
        drew the runner-up would return."""
        target = torch.randn(2, K + 1, V, generator=gen)
        scores = _race_scores(target[0, :1], seeds[:1], steps[:1])[0]
        best, second = scores.topk(2).indices.tolist()
        target[0, 0, second] += float(scores[best] - scores[second]) - gap
        sample = OpSample((target, greedy, target[:, :K].argmax(-1), num, seeds, steps))
        tokens, accepted = verify_drafts(*sample.args)
        assert int(tokens[0, 0]) == best
        other = tokens.clone()
        other[0, 0] = second
        return sample, (other, accepted)

    near, got = flipped(1e-5)
    _compare_verified(got, verify_drafts(*near.args), near, torch.float32)
    far, got = flipped(1e-2)
    with pytest.raises(AssertionError, match="instead of"):
        _compare_verified(got, verify_drafts(*far.args), far, torch.float32)
    tokens, accepted = verify_drafts(*near.args)
    changed = tokens.clone()
    changed[1, int(accepted[1])] = (changed[1, int(accepted[1])] + 1) % V
    with pytest.raises(AssertionError, match="greedy"):
        _compare_verified((changed, accepted), (tokens, accepted), near, torch.float32)

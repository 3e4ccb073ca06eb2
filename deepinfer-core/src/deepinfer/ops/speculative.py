"""Speculative verification: accept a request's drafts against the target's distributions, then draw its own token.

One op, row-wise per request (a backend fuses it into a few kernels).  Greedy rows accept while the draft equals the
target's argmax, then take the target's argmax.  Sampled rows follow Leviathan et al. / Chen et al.: draft ``x``
drawn from ``q`` is accepted with probability ``min(1, p(x) / q(x))``; the first rejection draws from the residual
``max(p - q, 0)`` (normalised); when every verified draft passes, a bonus token is drawn from ``p``.  The output
tokens are then distributed exactly as the target's.  A greedy drafter (``q`` absent) proposes a point mass.

Randomness is counter-based like :func:`~deepinfer.ops.sampling.sample_tokens`: the acceptance test of output
position ``s`` uses a hash of (seed, ``s`` ^ ACCEPT_SALT), the residual draw the race noise of (seed, ``s`` ^
RESIDUAL_SALT), and the bonus token the plain noise of (seed, ``s``), i.e. exactly the token non-speculative
sampling draws there.  A drafter that samples its drafts on the device draws them with the noise of (seed,
position ^ DRAFT_SALT).  A seeded request is deterministic whatever its batch.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, Rows, reference_op
from deepinfer.ops.sampling import _race_scores, uniform_noise

#: Output positions are far below 2**30, so these salts give each draw its own noise stream.
ACCEPT_SALT = 1 << 30
RESIDUAL_SALT = 1 << 31
#: The drafter's own draws (DSpark's sampled drafts).  A draft must be drawn independently of the acceptance test
#: and of the residual / bonus draws that judge it: with a shared noise stream the accepted tokens' distribution
#: would no longer be the target's.  ``3 << 30`` keeps its steps apart from the plain, accept and residual ones.
DRAFT_SALT = 3 << 30


def _verify_samples(dtype: torch.dtype, gen: torch.Generator):
    b, k, v = 4, 3, 40
    target = torch.randn(b, k + 1, v, generator=gen) * 2.0
    greedy = torch.tensor([True, False, False, True])
    q = torch.softmax(torch.randn(b, k, v, generator=gen), dim=-1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
    drafts[0] = target[0, :k].argmax(-1)  # a greedy row whose drafts all match
    seeds = torch.tensor([3, -5, 1 << 40, 7], dtype=torch.int64)
    steps = torch.tensor([0, 4, 9, 2], dtype=torch.int64)
    num = torch.tensor([3, 3, 1, 0], dtype=torch.int64)
    yield OpSample((target.to(dtype), greedy, drafts, q, num, seeds, steps), label="mixed")
    yield OpSample((target.to(dtype), greedy, drafts, None, num, seeds, steps), label="greedy drafter")


def _verify_rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    """A sub-batch of requests (``draft_probs`` may be None: a greedy drafter)."""
    return OpSample(tuple(a[rows] if a is not None else None for a in sample.args), dict(sample.kwargs), sample.label)


def _draft_tests(
    target: torch.Tensor, greedy: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each draft's test on its own: (passes [B, K] bool; margin [B, K] float64 = log p(x) - log(u q(x)), the
    sampled test's distance from its threshold, +inf on greedy rows).  Rows past ``num_drafts`` never pass."""
    b, k1, v = target.shape
    k = k1 - 1
    device = target.device
    j = torch.arange(k, device=device)
    valid = j[None, :] < num_drafts[:, None]
    x = draft_tokens.clamp(0, v - 1)
    logp = torch.log_softmax(target[:, :k].float(), dim=-1)
    p_x = logp.gather(-1, x[..., None])[..., 0].exp()
    q_x = draft_probs.gather(-1, x[..., None])[..., 0].float() if draft_probs is not None else torch.ones_like(p_x)
    pos = steps[:, None] + j[None, :]
    u = uniform_noise(seeds.repeat_interleave(k), (pos ^ ACCEPT_SALT).flatten(), 1).view(b, k)
    sampled_ok = u * q_x.double() <= p_x.double()
    greedy_ok = x == target[:, :k].argmax(dim=-1)
    ok = torch.where(greedy[:, None], greedy_ok, sampled_ok) & valid & (draft_tokens >= 0)
    margin = torch.where(greedy[:, None], torch.inf, p_x.double().log() - (u * q_x.double()).log())
    return ok, margin


def _own_scores(
    target: torch.Tensor, greedy: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, accepted: torch.Tensor,
) -> torch.Tensor:
    """The scores [B, V] float64 whose argmax is each request's own token once it accepted ``accepted`` drafts:
    the logits (greedy), the residual's race (a rejection) or the plain race (the bonus token)."""
    b, k1, v = target.shape
    k = k1 - 1
    device = target.device
    rows = torch.arange(b, device=device)
    final_logits = target[rows, accepted]  # [B, V]: the row after the last accepted draft
    p = torch.log_softmax(final_logits.float(), dim=-1).exp()
    at = accepted.clamp(max=max(k - 1, 0))  # the rejected draft's row (unused where none was rejected)
    q = torch.zeros(b, v, device=device)
    if k and draft_probs is not None:
        q = draft_probs[rows, at].float()
    elif k:  # a greedy drafter's point mass
        q.scatter_(1, draft_tokens.clamp(0, v - 1)[rows, at][:, None], 1.0)
    residual = (p - q).clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    position = steps + accepted
    noise = uniform_noise(seeds, position ^ RESIDUAL_SALT, v)
    residual_race = residual.double().log() - torch.log(-torch.log(noise))
    bonus_race = _race_scores(final_logits, seeds, position)
    rejected = accepted < num_drafts
    sampled = torch.where(rejected[:, None], residual_race, bonus_race)
    return torch.where(greedy[:, None], final_logits.double(), sampled)


def _compare_verified(
    actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], sample: OpSample,
    dtype: torch.dtype,
) -> None:
    """Greedy requests must match exactly.  A sampled request may differ only where another implementation's
    rounding can flip a near-tie: each of its acceptance decisions agrees with the reference's test or lies within
    1e-4 of the threshold (in log space), and its own token is the reference's draw after the drafts it accepted,
    or one within 1e-4 of it in the race (the tolerance of ``sample_tokens``)."""
    target, greedy, drafts, probs, num, seeds, steps = sample.args
    tokens, accepted = (t.cpu() for t in actual)
    assert tokens.shape == expected[0].shape and tokens.dtype == expected[0].dtype, "verify_drafts: tokens' shape"
    assert accepted.shape == expected[1].shape and accepted.dtype == expected[1].dtype, "verify_drafts: counts"
    if torch.equal(tokens, expected[0]) and torch.equal(accepted, expected[1]):
        return
    ok, margin = _draft_tests(target, greedy, drafts, probs, num, seeds, steps)
    scores = _own_scores(target, greedy, drafts, probs, num, seeds, steps, accepted.clamp(0, target.shape[1] - 1))
    for i in (tokens != expected[0]).any(dim=1).nonzero().flatten().tolist():
        a = int(accepted[i])
        where = f"verify_drafts request {i} (accepted {a}, reference {int(expected[1][i])})"
        assert not bool(greedy[i]), f"{where}: a greedy request differs"
        assert 0 <= a <= int(num[i]), f"{where}: accepted count out of range"
        decided = [(j, True) for j in range(a)] + ([(a, False)] if a < int(num[i]) else [])
        for j, passed in decided:
            near = abs(float(margin[i, j])) < 1e-4 and int(drafts[i, j]) >= 0
            assert bool(ok[i, j]) == passed or near, f"{where}: draft {j} decided against its test"
        assert tokens[i, :a].tolist() == drafts[i, :a].tolist(), f"{where}: accepted tokens are not the drafts"
        assert bool((tokens[i, a + 1:] == -1).all()), f"{where}: no -1 after its own token"
        token, best = int(tokens[i, a]), int(scores[i].argmax())
        gap = float(scores[i, best] - scores[i, token]) if 0 <= token < target.shape[-1] else float("inf")
        assert gap < 1e-4, f"{where}: token {token} instead of {best} (gap {gap})"


@reference_op(sample_inputs=_verify_samples, dtypes=(torch.float32,), compare=_compare_verified,
              rows=Rows((0, 1, 2, 3, 4, 5, 6), _verify_rows))
def verify_drafts(
    target: torch.Tensor,
    greedy: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``num_drafts[b]`` drafts of each request ``b``.

    target [B, K+1, V] fp32: the target's logits for the rows after the anchor and after each draft, already
    penalised, masked, tempered and filtered as for sampling (softmax = the distribution sampled; greedy rows:
    argmax); greedy [B] bool; draft_tokens [B, K] int64; draft_probs [B, K, V] fp32 or None (greedy drafter);
    num_drafts [B] int64 in [0, K]; seeds [B] int64; steps [B] int64: the output position of row 0.
    Returns (tokens [B, K+1] int64: the accepted drafts, then the request's own token, then -1;
    num_accepted [B] int64).
    """
    b, k1, v = target.shape
    k = k1 - 1
    device = target.device
    args = (target, greedy, draft_tokens, draft_probs, num_drafts, seeds, steps)
    ok, _ = _draft_tests(*args)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    token = _own_scores(*args, accepted).argmax(dim=-1)

    rows = torch.arange(b, device=device)
    out = torch.full((b, k1), -1, dtype=torch.int64, device=device)
    keep = torch.arange(k1, device=device)[None, :] < accepted[:, None]
    out[:, :k] = torch.where(keep[:, :k], draft_tokens, out[:, :k])
    out[rows, accepted] = token
    return out, accepted

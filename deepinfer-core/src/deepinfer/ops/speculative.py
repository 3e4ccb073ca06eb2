"""Speculative verification by coupled sampling: every emitted token is the token plain sampling draws there.

One op, row-wise per request (a backend fuses it).  Target row ``j`` of a request (its next-token logits after the
anchor and drafts ``d1..dj``, processed as plain decoding processes output position ``s = step + j``) gives the token
plain decoding would emit at ``s``: the argmax (greedy), else :func:`~deepinfer.ops.sampling.sample_tokens`' race
over the counter-based noise of (seed, ``s``).  The request accepts ``d_{j+1}`` while it equals row ``j``'s token;
its own token is the token of the first row whose draft differs, or of the row after its last verified draft.

So a request's output is exactly its plain (non-speculative) output from the same processed logits, whatever the
drafter proposed, however many drafts a step verified, in any batch, preempted or not: the noise of a position is a
function of (seed, position) alone and nothing else decides the token.  Its distribution is the target's.

A sampled drafter is accepted most often when it draws its draft for output position ``s`` by the same race over its
own distribution ``q`` (:func:`~deepinfer.ops.sampling.sample_tokens` with (seed, ``s``)): the two races agree with
probability at least ``(1 - TV(p, q)) / (1 + TV(p, q))`` (the Gumbel-max coupling; Daliri, Musco and Suresh 2024,
"Coupling without communication and drafter-invariant speculative decoding").  Rejection sampling (Leviathan et al.
2023) accepts ``1 - TV``, but which rule emits a position's token there (an accepted draft, a residual draw or the
bonus draw) follows the draft schedule, so its output cannot be a function of the position's noise alone.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, reference_op
from deepinfer.ops.sampling import _race_scores, sample_tokens


def row_draws(target: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample_tokens``' arguments for every target row, flattened: (logits [B*(K+1), V], greedy, seeds, output
    positions ``step + j``), built on the device with no host data (a backend's verify is captured whole)."""
    b, k1, v = target.shape
    at = steps[:, None] + torch.arange(k1, device=target.device)[None, :]
    return (target.reshape(b * k1, v), greedy[:, None].expand(b, k1).reshape(-1),
            seeds[:, None].expand(b, k1).reshape(-1), at.reshape(-1))


def accept_agreeing(own: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_drafts``' result from each target row's token ``own`` [B, K+1]: the drafts accepted while they
    equal the row before them's token, then the token of the row after them, then -1."""
    k1 = own.shape[1]
    j = torch.arange(k1 - 1, device=own.device)
    agree = (draft_tokens == own[:, :-1]) & (j[None, :] < num_drafts[:, None])
    accepted = agree.long().cumprod(dim=1).sum(dim=1)
    keep = torch.arange(k1, device=own.device)[None, :] <= accepted[:, None]
    return torch.where(keep, own, torch.full_like(own, -1)), accepted


def _own_tokens(target: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B, K+1] int64: the token plain sampling draws from each target row at its output position ``step + j``."""
    return sample_tokens(*row_draws(target, greedy, seeds, steps)).view(target.shape[:2])


def _verify_samples(dtype: torch.dtype, gen: torch.Generator):
    b, k, v = 4, 3, 40
    target = torch.randn(b, k + 1, v, generator=gen) * 2.0
    greedy = torch.tensor([True, False, False, True])
    seeds = torch.tensor([3, -5, 1 << 40, 7], dtype=torch.int64)
    steps = torch.tensor([0, 4, 9, 2], dtype=torch.int64)
    # Drafts from a blurred target raced with the same noise (a coupled drafter): some agree, some do not.
    blurred = target + torch.randn(b, k + 1, v, generator=gen)
    drafts = _own_tokens(blurred, greedy, seeds, steps)[:, :k]
    drafts[0] = target[0, :k].argmax(-1)  # a greedy row whose drafts all match
    num = torch.tensor([3, 3, 1, 0], dtype=torch.int64)
    yield OpSample((target.to(dtype), greedy, drafts, num, seeds, steps), label="coupled drafts")


def _compare_verified(
    actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], sample: OpSample,
    dtype: torch.dtype,
) -> None:
    """Greedy requests must match exactly.  A sampled request may differ only where another implementation's
    rounding can flip a near-tie of a race (the tolerance of ``sample_tokens``): each token it emits is, within 1e-4,
    the winner of its row's race, its accepted tokens are its drafts, and the draft after them differs from its own
    token."""
    target, greedy, drafts, num, seeds, steps = sample.args
    tokens, accepted = (t.cpu() for t in actual)
    assert tokens.shape == expected[0].shape and tokens.dtype == expected[0].dtype, "verify_drafts: tokens' shape"
    assert accepted.shape == expected[1].shape and accepted.dtype == expected[1].dtype, "verify_drafts: counts"
    if torch.equal(tokens, expected[0]) and torch.equal(accepted, expected[1]):
        return
    rows, _, row_seeds, at = row_draws(target, greedy, seeds, steps)
    scores = _race_scores(rows, row_seeds, at).view(target.shape)
    v = target.shape[-1]
    for i in ((tokens != expected[0]).any(dim=1) | (accepted != expected[1])).nonzero().flatten().tolist():
        a = int(accepted[i])
        where = f"verify_drafts request {i} (accepted {a}, reference {int(expected[1][i])})"
        assert not bool(greedy[i]), f"{where}: a greedy request differs"
        assert 0 <= a <= int(num[i]), f"{where}: accepted count out of range"
        assert tokens[i, :a].tolist() == drafts[i, :a].tolist(), f"{where}: accepted tokens are not the drafts"
        assert bool((tokens[i, a + 1:] == -1).all()), f"{where}: no -1 after its own token"
        assert a == int(num[i]) or int(tokens[i, a]) != int(drafts[i, a]), f"{where}: rejected its own token"
        for j in range(a + 1):
            token, best = int(tokens[i, j]), int(scores[i, j].argmax())
            gap = float(scores[i, j, best] - scores[i, j, token]) if 0 <= token < v else float("inf")
            assert gap < 1e-4, f"{where}: token {token} at row {j} instead of {best} (gap {gap})"


@reference_op(sample_inputs=_verify_samples, dtypes=(torch.float32,), compare=_compare_verified,
              rows=(0, 1, 2, 3, 4, 5))
def verify_drafts(
    target: torch.Tensor,
    greedy: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``num_drafts[b]`` drafts of each request ``b``.

    target [B, K+1, V] fp32: the target's logits for the rows after the anchor and after each draft, already
    penalised, masked, tempered and filtered as for sampling (:meth:`~deepinfer.sample.Sampler.distribution`);
    greedy [B] bool; draft_tokens [B, K] int64 (negative: no draft, never accepted); num_drafts [B] int64 in
    [0, K]; seeds [B] int64; steps [B] int64: the output position of row 0.  Rows past a request's drafts are
    never read.  Returns (tokens [B, K+1] int64: the accepted drafts, then the request's own token, then -1;
    num_accepted [B] int64).
    """
    return accept_agreeing(_own_tokens(target, greedy, seeds, steps), draft_tokens, num_drafts)

"""Speculative verification: accept a request's drafts against the target's distributions, then draw its own token.

One op, row-wise per request (a backend fuses it into one kernel).  Greedy rows accept while the draft equals the
target's argmax, then take the target's argmax.  Sampled rows follow Leviathan et al. / Chen et al.: draft ``x``
drawn from ``q`` is accepted with probability ``min(1, p(x) / q(x))``; the first rejection draws from the residual
``max(p - q, 0)`` (normalised); when every verified draft passes, a bonus token is drawn from ``p``.  The output
tokens are then distributed exactly as the target's.  A greedy drafter (``q`` absent) proposes a point mass.

Randomness is counter-based like :func:`~deepinfer.ops.sampling.sample_tokens`: the acceptance test of output
position ``s`` uses a hash of (seed, ``s`` ^ ACCEPT_SALT), the residual draw the race noise of (seed, ``s`` ^
RESIDUAL_SALT), and the bonus token the plain noise of (seed, ``s``), i.e. exactly the token non-speculative
sampling draws there.  A seeded request is deterministic whatever its batch.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, Rows, reference_op
from deepinfer.ops.sampling import _race_scores, uniform_noise

#: Output positions are far below 2**30, so these salts give each draw its own noise stream.
ACCEPT_SALT = 1 << 30
RESIDUAL_SALT = 1 << 31


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


@reference_op(sample_inputs=_verify_samples, dtypes=(torch.float32,), rows=Rows((0, 1, 2, 3, 4, 5, 6), _verify_rows))
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
    j = torch.arange(k, device=device)
    valid = j[None, :] < num_drafts[:, None]
    x = draft_tokens.clamp(0, v - 1)
    logp = torch.log_softmax(target.float(), dim=-1)
    p_x = logp[:, :k].gather(-1, x[..., None])[..., 0].exp()
    q_x = draft_probs.gather(-1, x[..., None])[..., 0].float() if draft_probs is not None else torch.ones_like(p_x)
    pos = steps[:, None] + j[None, :]
    u = uniform_noise(seeds.repeat_interleave(k), (pos ^ ACCEPT_SALT).flatten(), 1).view(b, k)
    sampled_ok = u * q_x.double() <= p_x.double()
    greedy_ok = x == target[:, :k].argmax(dim=-1)
    ok = torch.where(greedy[:, None], greedy_ok, sampled_ok) & valid & (draft_tokens >= 0)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(b, device=device)
    final_logits = target[rows, accepted]  # [B, V]: the row after the last accepted draft
    at = accepted.clamp(max=max(k - 1, 0))  # the rejected draft's row (unused where none was rejected)
    q = torch.zeros(b, v, device=device)
    if k and draft_probs is not None:
        q = draft_probs[rows, at].float()
    elif k:  # a greedy drafter's point mass
        q.scatter_(1, x[rows, at][:, None], 1.0)
    residual = (logp[rows, accepted].exp() - q).clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, logp[rows, accepted].exp())
    position = steps + accepted
    noise = uniform_noise(seeds, position ^ RESIDUAL_SALT, v)
    residual_draw = (residual.double().log() - torch.log(-torch.log(noise))).argmax(dim=-1)
    bonus_draw = _race_scores(final_logits, seeds, position).argmax(dim=-1)
    rejected = accepted < num_drafts
    token = torch.where(greedy, final_logits.argmax(dim=-1), torch.where(rejected, residual_draw, bonus_draw))

    out = torch.full((b, k1), -1, dtype=torch.int64, device=device)
    keep = torch.arange(k1, device=device)[None, :] < accepted[:, None]
    out[:, :k] = torch.where(keep[:, :k], draft_tokens, out[:, :k])
    out[rows, accepted] = token
    return out, accepted

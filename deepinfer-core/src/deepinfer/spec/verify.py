"""Verification, host side: the target rows of each request's drafts, their grammar masks, and the verify op.

A request that verifies ``k`` drafts ``d1..dk`` after its anchor has ``k + 1`` target rows: row ``j`` is the
target's next-token distribution after the anchor and ``d1..dj``.  Each row is processed exactly as plain decoding
would process it at that output position (:meth:`~deepinfer.sample.Sampler.distribution`: penalties that count
``d1..dj`` as output, ``min_tokens`` bans at that position, the grammar's mask after accepting ``d1..dj``,
temperature and truncation), then :func:`~deepinfer.ops.speculative.verify_drafts` accepts a prefix and draws the
request's own token.  So greedy output is the plain argmax chain and sampled output has the plain distribution.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from deepinfer.ops import Ops
from deepinfer.sample.sampler import Sampler, signed64
from deepinfer.step import SamplingRow


def verify_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The ``len(drafts) + 1`` target rows of a request whose next token would be sampled with ``row``."""
    return [replace(row, step=row.step + j, output_ids=row.output_ids + drafts[:j]) for j in range(len(drafts) + 1)]


def grammar_rows(grammar: Any, drafts: list[int], vocab_size: int) -> tuple[torch.Tensor, int]:
    """The grammar masks of a request's target rows: (host int32 ``[len(drafts) + 1, ceil(V/32)]``, how many
    leading drafts the grammar allows).  ``grammar``: its ``GrammarMatcher``, left as it was.  Rows after the
    first disallowed draft are never used: the caller verifies only that many drafts."""
    mask = torch.zeros(len(drafts) + 1, (vocab_size + 31) // 32, dtype=torch.int32)  # xgrammar's layout
    return mask, grammar.fill_draft_bitmasks(drafts, mask, 0)


def verify(ops: Ops, sampler: Sampler, logits: torch.Tensor, rows: list[list[SamplingRow]], drafts: list[list[int]],
           draft_probs: torch.Tensor | None, bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's drafts.  ``logits`` fp32 ``[sum(k_i + 1), V]``: each request's target rows in order
    (``rows[i]`` from :func:`verify_rows`, ``k_i = len(drafts[i])``); ``draft_probs`` ``[B, >= max k, V]`` the
    drafter's q (None: greedy drafter); ``bitmask``: the rows' grammar masks or None.  Returns (tokens ``[B, K+1]``
    accepted drafts then the target's token then -1, accepted ``[B]``), on the logits' device."""
    device, vocab = logits.device, logits.shape[-1]
    flat = [r for group in rows for r in group]
    dist = sampler.distribution(logits, flat, bitmask)
    k_max = max((len(d) for d in drafts), default=0)
    b = len(drafts)
    index = [i * (k_max + 1) + j for i, group in enumerate(rows) for j in range(len(group))]
    target = torch.zeros(b * (k_max + 1), vocab, dtype=dist.dtype, device=device)
    target.index_copy_(0, sampler.upload(torch.tensor(index, dtype=torch.int64), device), dist)
    tokens = torch.tensor([d + [0] * (k_max - len(d)) for d in drafts], dtype=torch.int64).view(b, k_max)
    first = [group[0] for group in rows]
    probs = draft_probs[:, :k_max].float() if draft_probs is not None else None
    return ops.verify_drafts(
        target.view(b, k_max + 1, vocab),
        sampler.upload(torch.tensor([r.params.greedy for r in first], dtype=torch.bool), device),
        sampler.upload(tokens, device),
        probs,
        sampler.upload(torch.tensor([len(d) for d in drafts], dtype=torch.int64), device),
        sampler.upload(torch.tensor([signed64(r.seed) for r in first], dtype=torch.int64), device),
        sampler.upload(torch.tensor([r.step for r in first], dtype=torch.int64), device),
    )


def forced(sampler: Sampler, logits: torch.Tensor, rows: list[list[SamplingRow]], drafts: list[list[int]],
           accept: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmarks only (lossy): accept the first ``accept[i]`` drafts of request ``i`` whatever they are, then draw
    its own token from the row after them as plain sampling would.  Same shapes as :func:`verify`."""
    device = logits.device
    starts, at = [], 0
    for group in rows:
        starts.append(at)
        at += len(group)
    picked = [starts[i] + min(a, len(d)) for i, (a, d) in enumerate(zip(accept, drafts, strict=True))]
    flat = [r for group in rows for r in group]
    dist = sampler.distribution(logits, flat)
    own = sampler.draw(dist[sampler.upload(torch.tensor(picked, dtype=torch.int64), device)],
                       [flat[p] for p in picked]).tolist()
    k_max = max((len(d) for d in drafts), default=0)
    out = torch.full((len(drafts), k_max + 1), -1, dtype=torch.int64)
    accepted = []
    for i, (a, d) in enumerate(zip(accept, drafts, strict=True)):
        a = min(a, len(d))
        out[i, :a] = torch.tensor(d[:a], dtype=torch.int64)
        out[i, a] = own[i]
        accepted.append(a)
    return out.to(device), torch.tensor(accepted, dtype=torch.int64, device=device)

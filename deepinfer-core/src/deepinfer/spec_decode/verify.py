"""Verification, host side: the target rows of each request's drafts, their grammar masks, and the verify op.

A request that verifies ``k`` drafts ``d1..dk`` after its anchor has ``k + 1`` target rows: row ``j`` is the
target's next-token distribution after the anchor and ``d1..dj``.  Each row is processed exactly as plain decoding
would process it at that output position (:meth:`~deepinfer.sample.Sampler.distribution`: penalties that count
``d1..dj`` as output, ``min_tokens`` bans at that position, the grammar's mask after accepting ``d1..dj``,
temperature and truncation), then :func:`~deepinfer.ops.speculative.verify_drafts` draws each row's token as plain
sampling draws it at that position and accepts the drafts that equal them.  So every emitted token is the plain
output's token (greedy and seeded sampling alike), whatever the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from deepinfer.ops import Ops
from deepinfer.sample.sampler import Sampler, signed64
from deepinfer.step import SamplingRow


def verify_rows(row: SamplingRow, drafts: list[int] | int) -> list[SamplingRow]:
    """The ``k + 1`` target rows of a request whose next token would be sampled with ``row``: row ``j`` at output
    position ``row.step + j`` with ``drafts[:j]`` counted as output.  ``drafts`` may be just their number ``k`` when
    their values stay on the device: only for a request without penalties (nothing else reads ``output_ids``)."""
    if isinstance(drafts, int):
        if row.params.has_penalties:
            raise ValueError("verify_rows: a request with penalties needs its drafts' values")
        return [replace(row, step=row.step + j) for j in range(drafts + 1)]
    return [replace(row, step=row.step + j, output_ids=row.output_ids + drafts[:j]) for j in range(len(drafts) + 1)]


def grammar_rows(grammar: Any, drafts: list[int], vocab_size: int) -> tuple[torch.Tensor, int]:
    """The grammar masks of a request's target rows: (host int32 ``[len(drafts) + 1, ceil(V/32)]``, how many
    leading drafts the grammar allows).  ``grammar``: its ``GrammarMatcher``, left as it was.  Rows after the
    first disallowed draft are never used: the caller verifies only that many drafts."""
    mask = torch.zeros(len(drafts) + 1, (vocab_size + 31) // 32, dtype=torch.int32)  # xgrammar's layout
    return mask, grammar.fill_draft_bitmasks(drafts, mask, 0)


def _padded_target(sampler: Sampler, logits: torch.Tensor, rows: list[list[SamplingRow]], k: int,
                   bitmask: torch.Tensor | None) -> torch.Tensor:
    """The processed target rows ``[B, k + 1, V]`` (padding rows zero: never read)."""
    dist = sampler.distribution(logits, [r for group in rows for r in group], bitmask)
    index = [i * (k + 1) + j for i, group in enumerate(rows) for j in range(len(group))]
    target = torch.zeros(len(rows) * (k + 1), logits.shape[-1], dtype=dist.dtype, device=logits.device)
    target.index_copy_(0, sampler.upload(torch.tensor(index, dtype=torch.int64), logits.device), dist)
    return target.view(len(rows), k + 1, -1)


def verify(ops: Ops, sampler: Sampler, logits: torch.Tensor, rows: list[list[SamplingRow]], drafts: torch.Tensor,
           counts: list[int], bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's drafts.  ``logits`` fp32 ``[sum(k_i + 1), V]``: each request's target rows in order
    (``rows[i]`` from :func:`verify_rows`, ``k_i = counts[i]``); ``drafts`` ``[B, >= max k_i]`` int64: the
    drafter's tokens on the logits' device; ``bitmask``: the rows' grammar masks or None.  Returns (tokens
    ``[B, K+1]``: accepted drafts, then the target's token, then -1; accepted ``[B]``), on the logits' device."""
    device = logits.device
    k = max(counts, default=0)
    first = [group[0] for group in rows]
    return ops.verify_drafts(
        _padded_target(sampler, logits, rows, k, bitmask),
        sampler.upload(torch.tensor([r.params.greedy for r in first], dtype=torch.bool), device),
        drafts[:, :k],
        sampler.upload(torch.tensor(counts, dtype=torch.int64), device),
        sampler.upload(torch.tensor([signed64(r.seed) for r in first], dtype=torch.int64), device),
        sampler.upload(torch.tensor([r.step for r in first], dtype=torch.int64), device),
    )


def forced(sampler: Sampler, logits: torch.Tensor, rows: list[list[SamplingRow]], drafts: torch.Tensor,
           counts: list[int], accept: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmarks only (lossy): accept the first ``accept[i]`` drafts of request ``i`` whatever they are, then draw
    its own token from the row after them as plain sampling would.  Same arguments and results as :func:`verify`."""
    device = logits.device
    k = max(counts, default=0)
    taken = [min(a, c) for a, c in zip(accept, counts, strict=True)]
    target = _padded_target(sampler, logits, rows, k, None)
    b = len(rows)
    at = sampler.upload(torch.tensor(taken, dtype=torch.int64), device)
    every = torch.arange(b, device=device)
    own = sampler.draw(target[every, at], [group[a] for group, a in zip(rows, taken, strict=True)])
    keep = torch.arange(k + 1, device=device)[None, :] < at[:, None]
    out = torch.where(keep, torch.nn.functional.pad(drafts[:, :k], (0, 1)), -1)
    out[every, at] = own
    return out, at


@dataclass(slots=True)
class ForcedAcceptance:
    """Benchmarks only (lossy; ``tools/bench/dspark.py``): a mean acceptance length ``length`` (tokens per verify
    step).  Each step accepts ``length - 1`` drafts on average, alternating floor and ceil, whatever the target
    says (:func:`forced`)."""

    length: float
    steps: int = 0

    def __post_init__(self) -> None:
        if not self.length >= 1.0:
            raise ValueError(f"forced_acceptance must be a mean acceptance length >= 1 (tokens per verify step), "
                             f"got {self.length}")

    def next_count(self) -> int:
        """Drafts the next step accepts (of each speculating request)."""
        x, t = self.length - 1.0, self.steps
        self.steps += 1
        return int(x * (t + 1)) - int(x * t)

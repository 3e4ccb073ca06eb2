"""How many draft tokens each request verifies this step (DSpark confidence-scheduled verification).

Policy, on plain data (no tensors; tested like the scheduler):

- ``DEEPINFER_ENABLE_MTP_VARLEN=0`` (default) or no cost table: every request verifies its whole draft (``caps``),
  so its tokens never depend on the rest of the batch.
- ``=1`` with a cost table: position ``j`` (1-based) of request ``r`` survives with ``S(r, j) = prod conf(r, 1..j)``,
  the chance that drafts ``1..j`` are all accepted.  Every request verifies at least one draft; the other
  ``(request, position)`` slots are ranked globally by ``S`` (ties: position, then request) and the best ``B`` are
  admitted.  ``S`` never grows along a request, so each request's admitted set is a prefix.  ``B`` maximises
  ``expected accepted tokens / step cost``: a request verifying ``k`` drafts yields ``1 + S(r,1) + .. + S(r,k)``
  tokens on average (the target's own token always comes), and the step costs ``table.cost(tokens)``.

The confidences are the drafter's from the previous step (a snapshot the host already holds), so choosing the
lengths never waits on the device; a request without one counts as certain (conf 1: verify everything).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CostTable:
    """Measured cost of one target step by the number of tokens it runs: ``costs[i]`` for any step of at most
    ``buckets[i]`` tokens (a captured graph bucket pads up to its size).  Any unit; only ratios matter."""

    buckets: tuple[int, ...]
    costs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.buckets or len(self.buckets) != len(self.costs):
            raise ValueError(f"CostTable needs one cost per bucket, got {len(self.buckets)} buckets and "
                             f"{len(self.costs)} costs")
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"CostTable buckets must be positive and strictly increasing, got {self.buckets}")
        if any(not c > 0 for c in self.costs):
            raise ValueError(f"CostTable costs must be > 0, got {self.costs}")

    def cost(self, num_tokens: int) -> float:
        """The cost of a step of ``num_tokens`` tokens: its bucket's; past the last bucket, linear in the tokens."""
        i = bisect.bisect_left(self.buckets, num_tokens)
        if i < len(self.buckets):
            return self.costs[i]
        return self.costs[-1] * num_tokens / self.buckets[-1]


def survival(confidence: list[float]) -> list[float]:
    """``S(j) = prod conf(1..j)`` for each position ``j`` of one request's draft."""
    out, s = [], 1.0
    for c in confidence:
        s *= min(max(float(c), 0.0), 1.0)
        out.append(s)
    return out


def verify_lengths(caps: list[int], confidences: list[list[float] | None], base_tokens: int,
                   table: CostTable | None, varlen: bool) -> list[int]:
    """Drafts each request verifies this step.

    ``caps[r]``: the most request ``r`` may verify (draft length, capped by its ``max_tokens``; 0: it samples
    without drafts), one entry per request that samples this step.  ``confidences[r]``: its drafter's
    confidences from the previous step (None: unknown, treated as 1).  ``base_tokens``: the step's tokens
    besides the drafts (prefill chunks, each decode's anchor row).
    """
    if len(caps) != len(confidences):
        raise ValueError(f"verify_lengths: {len(caps)} caps but {len(confidences)} confidence rows")
    if not varlen or table is None:
        return list(caps)
    floor = [min(cap, 1) for cap in caps]
    mandatory = 0.0
    slots: list[tuple[float, int, int]] = []  # (-S, position, request): sorts best first, ties by position, request
    for r, (cap, conf) in enumerate(zip(caps, confidences, strict=True)):
        s = survival(list(conf[:cap]) + [1.0] * max(0, cap - len(conf)) if conf is not None else [1.0] * cap)
        mandatory += sum(s[: floor[r]])
        slots += [(-s[j], j, r) for j in range(floor[r], cap)]
    slots.sort()
    tokens = base_tokens + sum(floor)
    expected = len(caps) + mandatory  # every request's own token, then its drafts'
    best_ratio, best_budget = expected / table.cost(tokens), 0
    for b, (neg_s, _, _) in enumerate(slots, start=1):
        expected -= neg_s
        ratio = expected / table.cost(tokens + b)
        if ratio > best_ratio:
            best_ratio, best_budget = ratio, b
    out = list(floor)
    for _, _, r in slots[:best_budget]:
        out[r] += 1
    return out


@dataclass(slots=True, frozen=True)
class SpecPolicy:
    """What the scheduler needs to give decoding sequences drafts: the longest draft (``DEEPINFER_USE_NEXTN_DECODE``
    within the drafter's block), whether lengths follow the confidences (``DEEPINFER_ENABLE_MTP_VARLEN``), and the
    measured step costs (None: not profiled, verify every draft)."""

    max_draft_len: int
    varlen: bool = False
    cost_table: CostTable | None = None

    def __post_init__(self) -> None:
        if self.max_draft_len < 1:
            raise ValueError(f"SpecPolicy.max_draft_len must be >= 1, got {self.max_draft_len}")

    def lengths(self, caps: list[int], confidences: list[list[float] | None], base_tokens: int) -> list[int]:
        """:func:`verify_lengths` under this policy (``caps`` already within ``max_draft_len``)."""
        return verify_lengths(caps, confidences, base_tokens, self.cost_table, self.varlen)

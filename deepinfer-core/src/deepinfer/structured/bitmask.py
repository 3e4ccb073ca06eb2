"""The batch's token bitmask: filled on the CPU from each request's matcher, applied on the device.

Row ``i`` belongs to the ``i``-th sampled row of the step.  Free (unconstrained) requests get all-ones
rows, so constrained and free requests share one tensor and one ``apply_token_bitmask`` call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xgrammar as xgr

from deepinfer.structured.matcher import ALL_ALLOWED, GrammarMatcher, bitmask_width

_batch_filler: xgr.BatchGrammarMatcher | None = None
_batch_filler_lock = threading.Lock()


def allocate_token_bitmask(num_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An all-allowed CPU bitmask ``[num_rows, ceil(vocab_size / 32)]`` int32 (pinned for async copies)."""
    mask = torch.empty((num_rows, bitmask_width(vocab_size)), dtype=torch.int32, pin_memory=pin_memory)
    return mask.fill_(ALL_ALLOWED)


def fill_token_bitmask(matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor) -> bool:
    """Fill ``bitmask[i]`` from ``matchers[i]`` (``None``: a free request, all allowed).

    ``bitmask`` is a CPU int32 tensor with at least ``len(matchers)`` rows.  Returns whether any row is
    constrained, so a step without structured requests can skip applying the mask.
    """
    if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)} "
                         f"on {bitmask.device}")
    if bitmask.shape[0] < len(matchers):
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {len(matchers)} requests")
    live: list[GrammarMatcher] = []
    rows: list[int] = []
    for row, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[row] = ALL_ALLOWED
        elif matcher.is_terminated():
            matcher.fill_bitmask(bitmask, row)
        else:
            live.append(matcher)
            rows.append(row)
    if len(live) == 1:
        live[0].fill_bitmask(bitmask, rows[0])
    elif live:
        _filler().batch_fill_next_token_bitmask([m._matcher for m in live], bitmask, rows)
    return any(m is not None for m in matchers)


def fill_draft_token_bitmask(
    matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]], bitmask: torch.Tensor
) -> list[int]:
    """Mask rows for a speculative step: request ``i`` owns ``len(drafts[i]) + 1`` consecutive rows.

    Returns, per request, how many leading draft tokens its grammar allows (free requests: all).
    No matcher's state changes; see :meth:`GrammarMatcher.fill_draft_bitmasks`.
    """
    if len(matchers) != len(drafts):
        raise ValueError(f"{len(matchers)} matchers for {len(drafts)} drafts")
    needed = sum(len(d) + 1 for d in drafts)
    if bitmask.shape[0] < needed:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows; the drafts need {needed}")
    allowed: list[int] = []
    row = 0
    for matcher, draft in zip(matchers, drafts, strict=True):
        if matcher is None:
            bitmask[row : row + len(draft) + 1] = ALL_ALLOWED
            allowed.append(len(draft))
        else:
            allowed.append(matcher.fill_draft_bitmasks(draft, bitmask, row))
        row += len(draft) + 1
    return allowed


def _filler() -> xgr.BatchGrammarMatcher:
    global _batch_filler
    with _batch_filler_lock:
        if _batch_filler is None:
            _batch_filler = xgr.BatchGrammarMatcher(max_threads="auto")
        return _batch_filler

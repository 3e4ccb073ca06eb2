"""What a V4.1 verify step leaves to do once the verifier has decided how many of each sequence's rows it keeps.

A verify step (:class:`~deepinfer.kv.decode_plan.DecodeStep` with ``starts``: each sequence's anchor and drafts,
``q`` rows) writes every row's ring row, entries and indexer keys as it goes: rows past the kept ones are never
read (a ring row is rewritten before a later query reaches it, an entry before it is complete at a query).  The
slot's carry-over is different: later steps read it.  So the step leaves it alone and records what it needs,
and :func:`commit` writes the carry-over after the kept rows: the Engram history from the look-back row of the
last kept token, and each compressor's unfinished-window rows from the step's projections.  The state then
equals the state after feeding the kept tokens one decode step at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.kv.state import PooledState
from deepinfer.models.deepseek_v41.engram_hash import history_after


@dataclass(slots=True)
class VerifyRecord:
    """Device tensors of one verify step that :func:`commit` reads (a captured step rewrites them in place)."""

    lookback: torch.Tensor | None = None  # [T, N] each row's Engram look-back (None: no Engram layer)
    #: Per compressor with a carry-over: (its ``pending`` [slots, ratio, width], the step's projections [T, width])
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def commit(record: VerifyRecord, history: torch.Tensor | None, states: list[PooledState], kept: list[int], q: int,
           upload: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Keep the first ``kept[i]`` rows of sequence ``i`` (rows ``i * q ..``): write the carry-over they leave and
    advance the states.  ``history``: the pool's Engram history [slots, N - 1] (None: none)."""
    index: list[int] = []  # flat rows of the step whose look-back gives each sequence's history
    for i, n in enumerate(kept):
        if not 1 <= n <= q:
            raise ValueError(f"kept[{i}] = {n}: a verify step keeps 1 .. {q} rows of a sequence")
        index.append(i * q + n - 1)
    pieces = [torch.tensor(index, dtype=torch.int64), torch.tensor([s.slot or 0 for s in states], dtype=torch.int64)]
    ratios = sorted({pending.shape[1] for pending, _ in record.pending})
    for r in ratios:  # row of each carry-over row, per sequence: the newest kept token at position = i mod r
        dst, src = _carry_rows(states, kept, q, r)
        pieces += [dst, src]
    flat = upload(torch.cat(pieces))
    n_seq = len(states)
    last, slots = flat[:n_seq], flat[n_seq : 2 * n_seq]
    if history is not None and record.lookback is not None:
        history.index_copy_(0, slots, history_after(record.lookback, last))
    at, rows = 2 * n_seq, {}
    for r in ratios:
        count = n_seq * r
        rows[r] = (flat[at : at + count], flat[at + count : at + 2 * count])
        at += 2 * count
    for pending, proj in record.pending:
        dst, src = rows[pending.shape[1]]
        carry = pending.view(-1, proj.shape[1])
        # src -1: the row keeps what it holds (its token is older than the step)
        carry.index_copy_(0, dst, torch.where((src >= 0)[:, None], proj[src.clamp(min=0)], carry[dst]))
    for state, n in zip(states, kept, strict=True):
        state.num_tokens += n


def _carry_rows(states: list[PooledState], kept: list[int], q: int, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(carry-over rows ``slot * ratio + j``, the step row holding the newest kept token at a position ``= j mod
    ratio``, or -1 where that token is older than the step): after feeding tokens one at a time, row ``j`` holds
    exactly that token."""
    dst, src = [], []
    for i, (state, n) in enumerate(zip(states, kept, strict=True)):
        start, end = state.num_tokens, state.num_tokens + n  # the step's positions start .. end - 1 are kept
        for j in range(ratio):
            newest = end - 1 - (end - 1 - j) % ratio
            dst.append((state.slot or 0) * ratio + j)
            src.append(i * q + newest - start if newest >= start else -1)
    return torch.tensor(dst, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)

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

from deepinfer.kv.pool import PooledState
from deepinfer.models.deepseek_v41.engram_hash import history_after


@dataclass(slots=True)
class VerifyRecord:
    """Device tensors of one verify step that :func:`commit` reads (a captured step rewrites them in place)."""

    lookback: torch.Tensor | None = None  # [T, N] each row's Engram look-back (None: no Engram layer)
    #: Per compressor with a carry-over: (its ``pending`` [slots, ratio, width], the step's projections [T, width])
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def commit(record: VerifyRecord, history: torch.Tensor | None, states: list[PooledState], kept: torch.Tensor, q: int,
           upload: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list[int]], None]:
    """Queue the carry-over writes of keeping the first ``kept[i]`` rows of sequence ``i`` (rows ``i * q ..``;
    ``kept`` [n] int64 on the device, 1 .. q each, never read here: the runner queues this before the step's
    read-back).  Returns what advances the states once the host holds the same counts.  ``history``: the pool's
    Engram history [slots, N - 1] (None: none)."""
    n_seq = len(states)
    host = upload(torch.tensor([s.num_tokens for s in states] + [s.slot or 0 for s in states], dtype=torch.int64))
    starts, slots = host[:n_seq], host[n_seq:]
    first = torch.arange(n_seq, device=kept.device) * q  # each sequence's first row in the step
    if history is not None and record.lookback is not None:  # the look-back row of the last kept token
        history.index_copy_(0, slots, history_after(record.lookback, first + kept - 1))
    for pending, proj in record.pending:
        dst, src = _carry_rows(starts, slots, first, kept, pending.shape[1])
        carry = pending.view(-1, proj.shape[1])
        # src -1: the row keeps what it holds (its token is older than the step)
        carry.index_copy_(0, dst, torch.where((src >= 0)[:, None], proj[src.clamp(min=0)], carry[dst]))

    def advance(counts: list[int]) -> None:
        for i, n in enumerate(counts):
            if not 1 <= n <= q:
                raise ValueError(f"kept[{i}] = {n}: a verify step keeps 1 .. {q} rows of a sequence")
        for state, n in zip(states, counts, strict=True):
            state.num_tokens += n

    return advance


def _carry_rows(starts: torch.Tensor, slots: torch.Tensor, first: torch.Tensor, kept: torch.Tensor, ratio: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(carry-over rows ``slot * ratio + j``, the step row holding the newest kept token at a position ``= j mod
    ratio``, or -1 where that token is older than the step), flat over (sequence, j): after feeding tokens one at
    a time, row ``j`` holds exactly that token."""
    j = torch.arange(ratio, device=kept.device)
    end = (starts + kept)[:, None]  # the step's positions starts .. end - 1 are kept
    newest = end - 1 - (end - 1 - j) % ratio  # (a tensor's % takes the divisor's sign, as Python's)
    src = torch.where(newest >= starts[:, None], first[:, None] + newest - starts[:, None], -1)
    return (slots[:, None] * ratio + j).flatten(), src.flatten()

"""Balanced context parallelism for ragged (prefill) steps: the rows of a step split over the CP ranks.

**Zigzag split**: each sequence's chunk of ``n`` rows is cut into ``2 * cp`` blocks (boundaries
``floor(n * j / (2 * cp))``); CP rank ``i`` takes blocks ``i`` and ``2 * cp - 1 - i``.  Causal attention work grows
with the position, so an early block and its mirror from the end cost every rank the same.

**What is split, what is not**: every per-token computation (embedding, mHC, the MoE, the queries' attention and
output projection) runs on the rank's own rows.  At each attention layer the ranks all-gather the layer's input,
so key-side work (the K=V latent, SWA ring updates, compressor windows and compressed entries, indexer keys and
picks) runs on every row on every CP rank: each holds the whole sequence state, identical everywhere, which is
why windows and entries that straddle the split are exact (they are never split).  The attention itself
(queries x window + picked entries) runs on own rows only (``RaggedLayout.query_rows``).  The final hidden
states are all-gathered, so every CP rank samples the same tokens and its engine stays in step with the others.
Decode steps (one token per sequence) are not split: every CP rank runs them whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.kv.layout import RaggedLayout
from deepinfer.parallel.comm import Communicator
from deepinfer.parallel.context import ParallelContext


def zigzag_rows(seq_lens: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """The flat-batch rows CP rank ``cp_rank`` owns (ascending)."""
    blocks = 2 * cp_size
    rows: list[int] = []
    offset = 0
    for n in seq_lens:
        cut = [n * j // blocks for j in range(blocks + 1)]
        for b in sorted({cp_rank, blocks - 1 - cp_rank}):
            rows += range(offset + cut[b], offset + cut[b + 1])
        offset += n
    return rows


@dataclass(slots=True)
class ContextSplit:
    """One step's rows over the CP group: this rank's rows, and how to put every rank's rows back in order."""

    comm: Communicator
    rows: torch.Tensor  # [own] int64: this rank's rows of the step
    counts: list[int]  # rows of each CP rank
    order: torch.Tensor  # [T] int64: the step row of each gathered row (ranks' rows concatenated)

    @classmethod
    def build(cls, comm: Communicator, seq_lens: list[int], device: torch.device) -> ContextSplit | None:
        """The split of a step of ``seq_lens``; None when some rank would get no row (a short step: it runs
        whole on every rank, as every rank decides alike)."""
        per_rank = [zigzag_rows(seq_lens, comm.size, r) for r in range(comm.size)]
        if not all(per_rank):
            return None
        own = torch.tensor(per_rank[comm.rank], dtype=torch.int64, device=device)
        order = torch.tensor([row for rows in per_rank for row in rows], dtype=torch.int64, device=device)
        return cls(comm, own, [len(r) for r in per_rank], order)

    def gather(self, own: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of a per-row tensor (``own``: this rank's), in step order."""
        size = self.comm.size
        got, _ = self.comm.all_to_all(own.repeat(size, *[1] * (own.dim() - 1)), [own.shape[0]] * size, self.counts)
        full = torch.empty_like(got)
        full[self.order] = got
        return full


def context_split(parallel: ParallelContext | None, seq_lens: list[int], device: torch.device
                  ) -> ContextSplit | None:
    """How this rank splits a ragged step of ``seq_lens``; None: it runs the step whole (no CP, or too short)."""
    if parallel is None or parallel.plan.cp_size == 1:
        return None
    return ContextSplit.build(parallel.cp, seq_lens, device)


def run_split(run: Callable[..., torch.Tensor], split: ContextSplit, layout: RaggedLayout, input_ids: torch.Tensor,
              attend: Callable[..., torch.Tensor], *per_row: torch.Tensor | None) -> torch.Tensor:
    """``run(input_ids, *per_row, attend)`` (a model's layer loop) on this rank's rows, attention inputs gathered
    from every rank; the hidden states of every row.  ``per_row``: more per-row inputs of ``run`` (or None)."""

    def attend_gathered(attn: Any, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return attend(attn, split.gather(x), *rest)

    layout.query_rows = split.rows
    try:
        mine = [t[split.rows] if t is not None else None for t in per_row]
        hidden = run(input_ids[split.rows], *mine, attend_gathered)
    finally:
        layout.query_rows = None
    return split.gather(hidden)

"""Engram tables sharded over the EP group: rank ``r`` holds rows ``[r * ceil(n / ep), (r + 1) * ceil(n / ep))``
of each table (``ParallelContext.table_rows``; the checkpoint reader puts only those on the device), never a
whole replica.  A lookup sends each wanted row id to its owner and gets the row back (two all-to-alls, rows
moved as bytes so FP8 tables and their scales travel as stored); ranks with no tokens join with none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer.models.deepseek_v41.engram import Engram, EngramWeights, local_rows
from deepinfer.parallel.context import ParallelContext


class EngramShard:
    """The exchange of one Engram layer's table rows (``Engram.gather``)."""

    def __init__(self, context: ParallelContext, engram: Engram, num_rows: int):
        self.context, self.engram = context, engram
        self.per_rank = -(-num_rows // context.ep.size)
        held = engram.weights.table.shape[0]
        expected = context.table_rows("", num_rows)
        assert expected is not None and held == expected.stop - expected.start, (held, expected)

    def gather(self, ops: Any, weights: EngramWeights, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        comm = self.context.ep
        owner = flat // self.per_rank
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=comm.size).tolist()
        wanted, got = comm.all_to_all(flat[order] - owner[order] * self.per_rank, counts)
        rows, scales = local_rows(ops, weights, wanted)
        width = rows.shape[1] * rows.element_size()
        parts = [rows.contiguous().view(torch.uint8)]
        if scales is not None:
            parts.append(scales.contiguous().view(torch.uint8))
        back, _ = comm.all_to_all(torch.cat(parts, dim=1), got, counts)
        packed = torch.empty_like(back)
        packed[order] = back
        out = packed[:, :width].contiguous().view(rows.dtype)
        return out, (packed[:, width:].contiguous().view(scales.dtype) if scales is not None else None)

    def idle(self) -> None:
        flat = torch.empty(0, dtype=torch.int64, device=self.engram.weights.q_weight.device)
        self.gather(self.engram.ops, self.engram.weights, flat)


def shard_engrams(context: ParallelContext | None, engrams: dict[int, Engram], layer_ids: Sequence[int],
                  num_rows: Sequence[int]) -> None:
    """Make each Engram layer (decoder layer ``layer_ids[i]``, a table of ``num_rows[i]`` rows) look its rows up
    across the EP group, when the tables are sharded (an expert placement); else leave them local."""
    if context is None or context.plan.placement is None:
        return
    for layer, rows in zip(layer_ids, num_rows, strict=True):
        shard = EngramShard(context, engrams[layer], rows)
        engrams[layer].gather, engrams[layer].idle = shard.gather, shard.idle
        context.join((layer, 0), shard.idle)

"""V4's KV compressor of CSA / HCA layers (paper §2.3): gated pooling of every ``ratio`` tokens into one entry.

Each token is projected to ``kv`` and ``gate``; a closed window's entry is ``sum_j softmax_j(gate_j + bias_j) *
kv_j`` per channel, RMS-normalised, then rotated (compress RoPE) at the window's first position.
With ``overlap`` (CSA) the projections are twice as wide, holding two series a and b: entry ``w`` pools series
b of window ``w`` together with series a of window ``w - 1`` (width ``2 * ratio``, stride ``ratio``).
Tokens of an unfinished window, and series a of the last closed one, wait in the sequence's state
(:class:`~deepinfer.layers.compressor.CompressorWindows`).
"""

from __future__ import annotations

import torch

from deepinfer.kv.decode_plan import RatioPlan
from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.pool import PooledState
from deepinfer.layers.compressor import CompressorWindows
from deepinfer.models.deepseek_v4.state import CompressorCache
from deepinfer.ops import Ops


class Compressor:
    def __init__(
        self,
        ops: Ops,
        position_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        ratio: int,
        overlap: bool,
        eps: float,
        inv_freq: torch.Tensor,
        rope_scaling: float,
    ):
        self.ops = ops
        self.position_bias, self.norm_weight = position_bias.float(), norm_weight  # fp32 bias: fp32 scores
        self.ratio, self.overlap, self.eps = ratio, overlap, eps
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling
        self.windows = CompressorWindows(ratio, position_bias.shape[-1], overlap)  # width: 2 x dim with overlap

    def _entries(self, window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
                 positions: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """Entries ``[n, dim]`` of windows ``[n, r, 2 * width]`` (kv | gate), rotated at ``positions``; with
        overlap ``previous`` [n, r, 2 * dim] holds series a (kv | gate) of each window's predecessor, missing
        where ``has_previous`` [n] is false (None: nowhere).  Rows not ``needed`` are zeros (None: all needed)."""
        return self.ops.compress_entries(window, previous, has_previous, self.position_bias, self.norm_weight,
                                         self.eps, positions, self.inv_freq, self.rope_scaling, needed)

    def __call__(self, proj: torch.Tensor, layout: RaggedLayout, states: list[PooledState],
                 cache: CompressorCache, out: torch.Tensor, kv_rows: bool) -> None:
        """Feed the new tokens' projections ``proj`` [T, 2 * width] (kv | gate); entries of closed windows go to
        their page rows of ``out`` (``kv_rows``: ``out`` is a layer's kv tensor, whose page 0 follows the rings).
        Where they go, their positions and predecessors come from the step's plan for the ratio."""
        plan = layout.plans[self.ratio]
        closed = self.windows.ragged(proj, layout, states, cache.pending, cache.overlap)
        if closed is not None:  # the step closes a window (the carry-over is updated either way)
            # a compressed ratio's plan has its closed windows' tables
            assert plan.closed_positions is not None and plan.closed_kv_rows is not None
            assert plan.closed_rows is not None
            has_previous = plan.closed_has_previous if self.overlap else None
            entries = self._entries(closed[0], closed[1], has_previous, plan.closed_positions)
            out.index_copy_(0, plan.closed_kv_rows if kv_rows else plan.closed_rows, entries)

    def decode(self, proj: torch.Tensor, slots: torch.Tensor, plan: RatioPlan, cache: CompressorCache,
               out: torch.Tensor) -> None:
        """Append each sequence's token to its slot's window; every row pools its window, and rows whose
        window closes write the entry to its row of ``out`` (the entry pages: the plan's ``entry_write``; the
        others write to the null page 0, which nothing reads)."""
        window, previous = self.windows.decode(proj, slots, plan, cache.pending, cache.overlap)
        # only closing windows become entries: the others are skipped (zeros, written to the unread page 0)
        has_previous = plan.has_previous if self.overlap else None
        entries = self._entries(window, previous, has_previous, plan.entry_positions, plan.closing)
        out.index_copy_(0, plan.entry_write, entries)

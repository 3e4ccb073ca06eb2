"""The KV compressor of CSA / HCA layers (paper §2.3): gated pooling of every ``ratio`` tokens into one entry.

Each token is projected to ``kv`` and ``gate``; a closed window's entry is ``sum_j softmax_j(gate_j + bias_j) *
kv_j`` per channel, RMS-normalised, then rotated (compress RoPE) at the window's first position.
With ``overlap`` (CSA) the projections are twice as wide, holding two series a and b: entry ``w`` pools series
b of window ``w`` together with series a of window ``w - 1`` (width ``2 * ratio``, stride ``ratio``).
Tokens of an unfinished window, and series a of the last closed one, wait in the sequence's state.
"""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.layout import RaggedLayout
from deepinfer.models.deepseek_v4.prefill_plan import WindowAssembly
from deepinfer.models.deepseek_v4.state import DeepseekV4State
from deepinfer.models.deepseek_v4.state_pool import CompressorCache
from deepinfer.models.deepseek_v4.step import RatioPlan
from deepinfer.ops import Ops

#: A ragged step with more sequences than this assembles its windows in one batch (:meth:`_batched_windows`);
#: below it the per-sequence path launches fewer kernels (~2-5 per sequence against ~10).
BATCHED_FROM = 3


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
        self.width = position_bias.shape[-1]  # kv / gate projection width (2 x dim with overlap)
        self.dim = self.width // 2 if overlap else self.width

    def _entries(self, window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
                 positions: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """Entries ``[n, dim]`` of windows ``[n, r, 2 * width]`` (kv | gate), rotated at ``positions``; with
        overlap ``previous`` [n, r, 2 * dim] holds series a (kv | gate) of each window's predecessor, missing
        where ``has_previous`` [n] is false (None: nowhere).  Rows not ``needed`` are zeros (None: all needed)."""
        return self.ops.compress_entries(window, previous, has_previous, self.position_bias, self.norm_weight,
                                         self.eps, positions, self.inv_freq, self.rope_scaling, needed)

    # --- any chunk lengths (prefill, mixed steps) ---------------------------------------------------
    def _windows(self, proj: torch.Tensor, cache: CompressorCache, slot: int, start: int):
        """The windows ``[n, r, 2 * width]`` a chunk starting at ``start`` closes and, with overlap, their
        predecessors' series a ``[n, r, 2 * dim]`` (else None); updates the slot's carry-over.  ``proj``
        [L, 2 * width]: the chunk's kv | gate projections."""
        r, d, w = self.ratio, self.dim, self.width
        held = start % r  # tokens of the unfinished window already in the slot
        if held:
            proj = torch.cat([cache.pending[slot, :held], proj])
        n = proj.shape[0] // r
        rest = proj.shape[0] - n * r
        cache.pending[slot, :rest] = proj[n * r :]
        if n == 0:
            return None
        windows = proj[: n * r].view(n, r, -1)
        previous = None
        if self.overlap:  # series a (kv | gate) of each window's predecessor
            series_a = torch.cat([windows[..., :d], windows[..., w : w + d]], dim=-1)
            overlap = _overlap(cache)
            previous = torch.cat([overlap[slot][None], series_a[:-1]])
            overlap[slot] = series_a[-1]
        return windows, previous

    def _batched_windows(self, proj: torch.Tensor, rows: WindowAssembly, cache: CompressorCache):
        """:meth:`_windows` for every sequence of the step at once (``rows``: the plan's gather rows): a fixed
        ~10 launches instead of ~2-5 per sequence.  The windows are read before the carry-over is rewritten."""
        r, d, w = self.ratio, self.dim, self.width
        pending = cache.pending.view(-1, 2 * w)
        slots = proj[rows.slot_src]  # [N * r, 2 * width]
        if rows.held_dst.numel():
            slots.index_copy_(0, rows.held_dst, pending[rows.held_src])
        if rows.carry_dst.numel():
            pending.index_copy_(0, rows.carry_dst, proj[rows.carry_src])
        windows = slots.view(-1, r, 2 * w)
        previous = None
        if self.overlap and windows.shape[0]:
            series_a = torch.cat([windows[..., :d], windows[..., w : w + d]], dim=-1)
            previous = series_a[rows.predecessor]
            overlap = _overlap(cache)
            previous.index_copy_(0, rows.first, overlap[rows.slots])
            overlap.index_copy_(0, rows.slots, series_a[rows.last])
        return windows, previous

    def __call__(self, proj: torch.Tensor, layout: RaggedLayout, states: list[DeepseekV4State],
                 cache: CompressorCache, out: torch.Tensor, kv_rows: bool) -> None:
        """Feed the new tokens' projections ``proj`` [T, 2 * width] (kv | gate); entries of closed windows go to
        their page rows of ``out`` (``kv_rows``: ``out`` is a layer's kv tensor, whose page 0 follows the rings).
        Where they go, their positions and predecessors come from the step's plan for the ratio."""
        plan = layout.plans[self.ratio]
        # A compressed ratio's plan (the only kind a compressor gets) has its closed windows' tables.
        assert plan.assembly is not None and plan.closed_positions is not None
        windows: torch.Tensor | None
        if len(states) > BATCHED_FROM:
            windows, previous = self._batched_windows(proj, plan.assembly, cache)
        else:  # a few sequences (a prefill): fewer launches one by one
            opened = [self._windows(proj[layout.rows(i)], cache, state.held_slot, layout.starts[i])
                      for i, state in enumerate(states)]
            closed = [c for c in opened if c is not None]
            windows = cat([w for w, _ in closed]) if closed else None
            previous = cat([p for _, p in closed if p is not None]) if closed and self.overlap else None
        if plan.closed_positions.shape[0]:  # the step closes a window (the carry-over is updated either way)
            rows = plan.closed_kv_rows if kv_rows else plan.closed_rows
            assert windows is not None and rows is not None  # windows closed: the plan has their rows
            has_previous = plan.closed_has_previous if self.overlap else None
            entries = self._entries(windows, previous, has_previous, plan.closed_positions)
            out.index_copy_(0, rows, entries)

    # --- one token per sequence (decode): fixed shapes, no host data -------------------------------
    def decode(self, proj: torch.Tensor, slots: torch.Tensor, plan: RatioPlan, cache: CompressorCache,
               out: torch.Tensor) -> None:
        """Append each sequence's token to its slot's window; every row pools its window, and rows whose
        window closes write the entry to its row of ``out`` (the entry pages: the plan's ``entry_write``; the
        others write to the null page 0, which nothing reads)."""
        d, w = self.dim, self.width
        cache.pending.view(-1, 2 * w).index_copy_(0, plan.pending_rows, proj)
        window = cache.pending[slots]  # [B, r, 2 * width]
        previous = has_previous = None
        if self.overlap:
            overlap = _overlap(cache)
            assert plan.overlap_slots is not None  # a CSA ratio's plan
            previous, has_previous = overlap[slots], plan.has_previous  # [B, r, 2 * dim], [B]
            # a closing window's series a (kv | gate: a view of kv a|b, gate a|b) replaces its slot's; the
            # others write to the null slot 0 (``previous`` was read before)
            series_a = window.unflatten(-1, (2, 2, d))[..., 0, :]
            overlap.unflatten(-1, (2, d)).index_copy_(0, plan.overlap_slots, series_a)
        # only closing windows become entries: the others are skipped (zeros, written to the unread page 0)
        entries = self._entries(window, previous, has_previous, plan.entry_positions, plan.closing)
        out.index_copy_(0, plan.entry_write, entries)


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` without the copy when there is one part (a one-sequence step: one kernel launch less)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _overlap(cache: CompressorCache) -> torch.Tensor:
    """Series a of the last closed windows: an overlapping compressor's cache always holds it."""
    assert cache.overlap is not None, "an overlapping compressor needs a cache with overlap"
    return cache.overlap

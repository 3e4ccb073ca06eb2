"""The windows a compressor closes (V4 paper §2.3): every ``ratio`` tokens' projections, with carry-over.

A compressed layer projects each token to ``kv | gate`` (``2 * width`` wide) and pools every ``ratio``
consecutive tokens into one entry.  This module only gathers the windows a step closes: tokens of an unfinished
window wait in the sequence's slot (``pending``, [slots, ratio, 2 * width]) until it closes, in a ragged step
(prefill chunks, mixed steps), one token at a time (decode), or as a verify step's rows (several a sequence; the
carry-over is then committed by the model once the kept rows are known).  With ``overlap`` (V4's CSA) the
projections hold two series a | b and each window also needs series a of its predecessor (``overlap``
[slots, ratio, 2 * dim]);
what a window becomes is the model's business (V4: :func:`~deepinfer.ops.compress.compress_entries`; V4.1:
a pooled latent that feeds both the entries and the indexer keys).
"""

from __future__ import annotations

import torch

from deepinfer.kv.decode_plan import RatioPlan
from deepinfer.kv.layout import RaggedLayout, WindowAssembly
from deepinfer.kv.pool import PooledState

#: A ragged step with more sequences than this assembles its windows in one batch (:meth:`_batched_windows`);
#: below it the per-sequence path launches fewer kernels (~2-5 per sequence against ~10).
BATCHED_FROM = 3

Windows = tuple[torch.Tensor, torch.Tensor | None]


class CompressorWindows:
    """Window assembly for one compressor: ``ratio`` tokens a window, ``width`` projection channels (of kv and
    of gate each; ``2 * dim`` with overlap)."""

    def __init__(self, ratio: int, width: int, overlap: bool):
        self.ratio, self.width, self.overlap = ratio, width, overlap
        self.dim = width // 2 if overlap else width

    # --- any chunk lengths (prefill, mixed steps) ---------------------------------------------------
    def ragged(self, proj: torch.Tensor, layout: RaggedLayout, states: list[PooledState], pending: torch.Tensor,
               overlap: torch.Tensor | None) -> Windows | None:
        """The windows ``[n, r, 2 * width]`` the step closes in batch order (the plan's ``closed_*`` order) and,
        with overlap, their predecessors' series a ``[n, r, 2 * dim]``; None if it closes none.  Updates the
        carry-over either way.  ``proj`` [T, 2 * width]: the step's kv | gate projections."""
        plan = layout.plans[self.ratio]
        if len(states) > BATCHED_FROM:
            assert plan.assembly is not None
            windows, previous = self._batched_windows(proj, plan.assembly, pending, overlap)
        else:  # a few sequences (a prefill): fewer launches one by one
            closed = [self._windows(proj[layout.rows(i)], pending, overlap, state.slot, layout.starts[i])
                      for i, state in enumerate(states)]
            found = [c for c in closed if c is not None]
            if not found:
                return None
            windows = cat([w for w, _ in found])
            previous = cat([p for _, p in found if p is not None]) if self.overlap else None
        return (windows, previous) if plan.closed_positions is not None and plan.closed_positions.shape[0] else None

    def _windows(self, proj: torch.Tensor, pending: torch.Tensor, overlap: torch.Tensor | None, slot: int | None,
                 start: int) -> Windows | None:
        """One sequence's chunk starting at ``start``."""
        r, d, w = self.ratio, self.dim, self.width
        held = start % r  # tokens of the unfinished window already in the slot
        if held:
            proj = torch.cat([pending[slot, :held], proj])
        n = proj.shape[0] // r
        rest = proj.shape[0] - n * r
        pending[slot, :rest] = proj[n * r :]
        if n == 0:
            return None
        windows = proj[: n * r].view(n, r, -1)
        previous = None
        if overlap is not None:  # series a (kv | gate) of each window's predecessor
            series_a = torch.cat([windows[..., :d], windows[..., w : w + d]], dim=-1)
            previous = torch.cat([overlap[slot][None], series_a[:-1]])
            overlap[slot] = series_a[-1]
        return windows, previous

    def _batched_windows(self, proj: torch.Tensor, rows: WindowAssembly, pending: torch.Tensor,
                         overlap: torch.Tensor | None) -> Windows:
        """:meth:`_windows` for every sequence of the step at once (``rows``: the plan's gather rows): a fixed
        ~10 launches instead of ~2-5 per sequence.  The windows are read before the carry-over is rewritten."""
        r, d, w = self.ratio, self.dim, self.width
        flat = pending.view(-1, 2 * w)
        slots = proj[rows.slot_src]  # [N * r, 2 * width]
        if rows.held_dst.numel():
            slots.index_copy_(0, rows.held_dst, flat[rows.held_src])
        if rows.carry_dst.numel():
            flat.index_copy_(0, rows.carry_dst, proj[rows.carry_src])
        windows = slots.view(-1, r, 2 * w)
        previous = None
        if overlap is not None and windows.shape[0]:
            series_a = torch.cat([windows[..., :d], windows[..., w : w + d]], dim=-1)
            previous = series_a[rows.predecessor]
            previous.index_copy_(0, rows.first, overlap[rows.slots])
            overlap.index_copy_(0, rows.slots, series_a[rows.last])
        return windows, previous

    # --- one token per sequence (decode): fixed shapes, no host data -------------------------------
    def decode(self, proj: torch.Tensor, slots: torch.Tensor, plan: RatioPlan, pending: torch.Tensor,
               overlap: torch.Tensor | None) -> Windows:
        """Append each sequence's token to its slot's window and return every row's window ``[B, r, 2 * width]``
        (only closing rows' become entries: ``plan.closing``) and, with overlap, the predecessors' series a.
        A closing window's series a then replaces its slot's; the others write to the null slot 0."""
        pending.view(-1, 2 * self.width).index_copy_(0, plan.pending_rows, proj)
        window = pending[slots]  # [B, r, 2 * width]
        previous = None
        if overlap is not None:
            assert plan.overlap_slots is not None
            previous = overlap[slots]  # [B, r, 2 * dim], read before it is rewritten
            # series a of kv | gate: a view of kv a|b, gate a|b
            series_a = window.unflatten(-1, (2, 2, self.dim))[..., 0, :]
            overlap.unflatten(-1, (2, self.dim)).index_copy_(0, plan.overlap_slots, series_a)
        return window, previous


    # --- a verify step's rows (several a sequence, fixed shapes): the carry-over is left alone --------
    def block(self, proj: torch.Tensor, plan: RatioPlan, pending: torch.Tensor) -> torch.Tensor:
        """Every row's window ``[T, r, 2 * width]`` of a verify step (``plan.block``): tokens of the step from
        ``proj``, older ones from the carry-over, which is not written (the caller commits it once it knows
        which rows are kept).  No overlap: a window's predecessor may be a row of the same step."""
        if self.overlap:
            raise NotImplementedError("verify-step windows of an overlapping compressor (V4's CSA)")
        block = plan.block
        assert block is not None, "a verify step's plan has block windows"
        carry = pending.view(-1, proj.shape[1])
        return torch.where(block.from_step[..., None], proj[block.step_rows], carry[block.pending_rows])


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` without the copy when there is one part (a one-sequence step: one kernel launch less)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)

"""The DSpark drafter's per-sequence context: each draft layer's K=V latents of the last ``sliding_window``
target positions, in rings indexed by state slot.

The context of a draft at anchor position P is the target features of positions P-W .. P-1 (W =
``sliding_window``), projected by ``main_proj`` / ``main_norm`` and then by each draft layer's own ``wkv`` /
``kv_norm`` / RoPE / FP8 (vLLM ``precompute_and_store_context_kv``, TensorRT-LLM's rolling windows).  A ring has
R = W + ``spare`` rows and position p lives at row ``p % R``; ``positions`` records which position each row holds
(-1: empty), so a row is read only if it holds a position in the draft's window: a truncated or partly filled ring
gives a shorter context, never a wrong one; a row never goes back to an older position (re-extending a position is
harmless).  The spare rows are for captured verify steps, which extend every row they ran, a sequence's rejected
drafts included (positions from the next anchor on, rewritten before any draft reads them): with ``spare`` >= the
drafts a step verifies, such a row never lands on a position still in the next draft's window.  Ring row R is a
scratch row: rows an ``extend`` call supersedes within the same call (more than R positions of one slot) or that
are older than what their row holds are written there, so every real row is written at most once per call (CUDA's
``index_copy_`` is not ordered between duplicate indices).
"""

from __future__ import annotations

import torch


class ContextRings:
    """``latents`` [slots, R + 1, layers, Dh] (model dtype) and ``positions`` [slots, R + 1] int64, R = ``window +
    spare`` ring rows and the scratch row."""

    def __init__(self, num_slots: int, num_layers: int, window: int, width: int, dtype: torch.dtype,
                 device: torch.device, spare: int = 0):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.window, self.num_slots, self.rows = window, num_slots, window + spare
        self.latents = torch.zeros(num_slots, self.rows + 1, num_layers, width, dtype=dtype, device=device)
        self.positions = torch.full((num_slots, self.rows + 1), -1, dtype=torch.int64, device=device)

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}) (the drafter's num_slots), got {slot}")

    def ring_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row ``p % R`` for each (slot, position), or the scratch row R for a position a later row of the same
        slot in this call overwrites (``p <= newest - R``)."""
        newest = torch.full((self.num_slots,), -1, dtype=torch.int64, device=positions.device)
        newest = newest.scatter_reduce(0, slots, positions, reduce="amax")
        kept = positions > newest[slots] - self.rows
        return torch.where(kept, positions % self.rows, self.rows)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, latents: list[torch.Tensor]) -> None:
        """Store each layer's latents [N, Dh] of rows (slot, position)."""
        rows = self.ring_rows(slots, positions)
        flat = slots * (self.rows + 1) + rows
        # a row that already holds a newer position keeps it (a late re-extend of an old position is dropped)
        flat = torch.where(self.positions.view(-1)[flat] > positions, slots * (self.rows + 1) + self.rows, flat)
        self.positions.view(-1).index_copy_(0, flat, positions)
        rows_view = self.latents.view(-1, *self.latents.shape[2:])
        rows_view.index_copy_(0, flat, torch.stack(latents, dim=1).to(self.latents.dtype))

    def window_of(self, slots: torch.Tensor, anchors: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per layer the rows [B * R, Dh] of ``slots``' rings, valid [B, R] bool: the row holds a position in
        ``[anchor - W, anchor)``)."""
        held = self.positions[slots, : self.rows]
        valid = (held >= 0) & (held < anchors[:, None]) & (held >= anchors[:, None] - self.window)
        rows = self.latents[slots, : self.rows]  # [B, R, layers, Dh]
        return [rows[:, :, i].reshape(-1, rows.shape[-1]) for i in range(rows.shape[2])], valid

    def truncate(self, slot: int, length: int) -> None:
        self.check_slot(slot)
        held = self.positions[slot]
        held.masked_fill_(held >= length, -1)

    def free(self, slot: int) -> None:
        self.check_slot(slot)
        self.positions[slot].fill_(-1)

    def fork(self, src: int, dst: int) -> None:
        self.check_slot(src)
        self.check_slot(dst)
        self.positions[dst].copy_(self.positions[src])
        self.latents[dst].copy_(self.latents[src])

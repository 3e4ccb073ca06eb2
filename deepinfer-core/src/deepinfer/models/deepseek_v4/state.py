"""Per-sequence state of DeepSeek-V4: what a chunk of new tokens needs from the tokens before it.

Per layer:
- an SWA ring of the last ``sliding_window`` K=V latents (slot = position mod window);
- for CSA / HCA layers, the compressor's state: projections of the tokens of the unfinished window, the
  previous window's series-a slice (CSA overlap), and the compressed entries emitted so far;
- for CSA layers, the same for the lightning indexer's own compressor (its entries are the indexer keys).
Feeding a prompt whole, in chunks or token by token leaves the same state behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_ENTRY_CAPACITY = 16


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def entry_capacity(needed: int) -> int:
    """Rows allocated for ``needed`` compressed entries: grows by doubling, so appends stay amortised O(1)."""
    cap = _MIN_ENTRY_CAPACITY
    while cap < needed:
        cap *= 2
    return cap


@dataclass(slots=True)
class CompressorState:
    """One compressor's carry-over between calls."""

    pending_kv: torch.Tensor  # [p < ratio, width] projections of the unfinished window's tokens
    pending_gate: torch.Tensor  # [p, width] their gate projections (position bias not yet added)
    overlap_kv: torch.Tensor | None  # [ratio, dim] series a of the last closed window (CSA only)
    overlap_gate: torch.Tensor | None  # [ratio, dim]
    entry_buffer: torch.Tensor  # [capacity, dim]; rows < num_entries are the compressed entries
    num_entries: int = 0

    @classmethod
    def empty(cls, width: int, dim: int, dtype: torch.dtype, device: torch.device) -> "CompressorState":
        none = torch.empty(0, width, dtype=dtype, device=device)
        return cls(none, none, None, None, torch.empty(0, dim, dtype=dtype, device=device))

    @property
    def entries(self) -> torch.Tensor:
        return self.entry_buffer[: self.num_entries]

    def append_entries(self, new: torch.Tensor) -> None:
        needed = self.num_entries + new.shape[0]
        if needed > self.entry_buffer.shape[0]:
            grown = self.entry_buffer.new_empty(entry_capacity(needed), self.entry_buffer.shape[1])
            grown[: self.num_entries] = self.entries
            self.entry_buffer = grown
        self.entry_buffer[self.num_entries : needed] = new
        self.num_entries = needed

    def nbytes(self) -> int:
        parts = (self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate, self.entry_buffer)
        return sum(_nbytes(t) for t in parts)

    def clone(self) -> "CompressorState":
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        return CompressorState(
            self.pending_kv.clone(), self.pending_gate.clone(), copy(self.overlap_kv), copy(self.overlap_gate),
            self.entry_buffer.clone(), self.num_entries,
        )


@dataclass(slots=True)
class LayerState:
    swa_ring: torch.Tensor  # [window, head_dim] (allocated on first use)
    window: int
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def swa_history(self, start: int) -> torch.Tensor:
        """K=V latents of positions ``max(0, start - window) .. start - 1`` in order."""
        if start == 0:
            return self.swa_ring[:0]
        first = max(0, start - self.window)
        slots = torch.arange(first, start, device=self.swa_ring.device) % self.window
        return self.swa_ring[slots]

    def swa_append(self, kv: torch.Tensor, start: int) -> None:
        """Write latents of positions ``start ..`` (only the last ``window`` of them can matter later)."""
        if self.swa_ring.shape[0] == 0:
            self.swa_ring = kv.new_zeros(self.window, kv.shape[-1])
        keep = min(kv.shape[0], self.window)
        first = start + kv.shape[0] - keep
        slots = torch.arange(first, first + keep, device=kv.device) % self.window
        self.swa_ring[slots] = kv[-keep:]

    def nbytes(self) -> int:
        return _nbytes(self.swa_ring) + sum(s.nbytes() for s in (self.compressor, self.indexer) if s is not None)

    def clone(self) -> "LayerState":
        return LayerState(
            self.swa_ring.clone(),
            self.window,
            None if self.compressor is None else self.compressor.clone(),
            None if self.indexer is None else self.indexer.clone(),
        )


@dataclass(slots=True)
class DeepseekV4State:
    """All state of one sequence (implements :class:`deepinfer.models.base.SequenceState`)."""

    layers: list[LayerState]
    num_tokens: int = 0

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def fork(self) -> "DeepseekV4State":
        return DeepseekV4State([layer.clone() for layer in self.layers], self.num_tokens)

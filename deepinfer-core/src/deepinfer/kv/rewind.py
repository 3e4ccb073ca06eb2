"""Undo a forward on pooled states: what speculative verification needs when the target rejects a draft.

A forward that advances a state from ``n`` to ``n + m`` tokens writes, in the pool:

- every ring row of positions ``n .. n + m - 1`` (row ``position % window`` of each ring of the slot), which held
  positions ``window`` earlier that the state at ``n`` tokens still attends;
- the slot's carry-over (:class:`~.spec.SlotBuffer`: a compressor's unfinished window and overlap, Engram's token
  history), which it replaces by the carry-over after ``n + m`` tokens;
- entries and page rows of windows that close at those positions: entry ``e >= n // ratio``, which a state of
  ``n`` tokens never reads (it reads ``n // ratio`` entries) and which feeding the tokens again rewrites.

So saving the first two before the forward and writing them back afterwards returns the state to exactly ``n``
tokens, whatever the model computes from them; the pages it reserved stay with the state (its budget already
covers them).  Saving is one gather per buffer, restoring one scatter per buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.pool import StatePool
from deepinfer.kv.spec import KVBuffer, SlotBuffer
from deepinfer.kv.state import PooledState


@dataclass(slots=True)
class PoolCheckpoint:
    """Saved rows of some states (see the module docstring); :meth:`restore` puts one state back."""

    pool: StatePool
    states: list[PooledState]
    num_tokens: list[int]
    ring_rows: list[torch.Tensor]  # per state: [m * rings] rows of every KV buffer with rings (same for each)
    saved: dict[str, list[torch.Tensor]]  # buffer name -> per state, its saved rows

    def restore(self, index: int) -> None:
        """Return state ``index`` to what it was when the checkpoint was taken."""
        state = self.states[index]
        for b in self.pool.spec.buffers:
            if b.name not in self.saved:
                continue
            t = self.pool.tensors[b.name]
            values = self.saved[b.name][index]
            if isinstance(b, KVBuffer):  # ring-major rows: a buffer with fewer rings owns a prefix
                rows = self.ring_rows[index][: values.shape[0]]
            else:
                rows = torch.tensor([state.slot], device=t.device)
            t.index_copy_(0, rows, values)
        state.num_tokens = self.num_tokens[index]


def _ring_rows(pool: StatePool, slot: int, rings: int, start: int, count: int) -> torch.Tensor:
    """Rows of positions ``start .. start + count - 1`` in every ring of ``slot`` (ring-major)."""
    window = pool.spec.window
    offsets = torch.arange(start, start + count) % window + slot * window
    return torch.cat([offsets + pool.ring_base(m) for m in range(rings)]).to(pool.device)


def checkpoint(states: list[PooledState], advances: list[int]) -> PoolCheckpoint:
    """Save what advancing each state by ``advances[i]`` tokens will overwrite.  Every state needs its slot
    (reserve first) and one pool."""
    pool = states[0].pool
    kv = [b for b in pool.spec.of(KVBuffer) if isinstance(b, KVBuffer) and b.rings]
    rings = max((b.rings for b in kv), default=0)
    ring_rows: list[torch.Tensor] = []
    saved: dict[str, list[torch.Tensor]] = {b.name: [] for b in pool.spec.buffers}
    for state, m in zip(states, advances, strict=True):
        if state.pool is not pool or state.slot is None:
            raise ValueError("checkpoint: every state must hold a slot of one pool")
        rows = _ring_rows(pool, state.slot, rings, state.num_tokens, min(m, pool.spec.window))
        ring_rows.append(rows)
        for b in pool.spec.buffers:
            t = pool.tensors[b.name]
            if isinstance(b, SlotBuffer):
                saved[b.name].append(t[state.slot : state.slot + 1].clone())
            elif isinstance(b, KVBuffer) and b.rings:
                per_ring = rows.numel() // rings
                saved[b.name].append(t[rows[: per_ring * b.rings]].clone())
    saved = {name: rows for name, rows in saved.items() if rows}
    return PoolCheckpoint(pool, list(states), [s.num_tokens for s in states], ring_rows, saved)

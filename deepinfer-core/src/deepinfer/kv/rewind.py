"""Undo a forward on pooled states: what speculative verification needs when the target rejects a draft.

A forward that advances a state from ``n`` to ``n + m`` tokens writes, in the pool:

- every ring row of positions ``n .. n + m - 1`` (row ``position % ring`` of each ring of the slot), which held
  positions ``window`` earlier that the state at ``n`` tokens still attends;
- the slot's carry-over (:class:`~.spec.SlotBuffer`: a compressor's unfinished window and overlap, Engram's token
  history), which it replaces by the carry-over after ``n + m`` tokens;
- entries and page rows of windows that close at those positions: entry ``e >= n // ratio``, which a state of
  ``n`` tokens never reads (it reads ``n // ratio`` entries) and which feeding the tokens again rewrites.

So saving the first two before the forward and writing them back afterwards returns the state to exactly ``n``
tokens, whatever the model computes from them; the pages it reserved stay with the state (its budget already
covers them).  Saving is one gather per buffer for all the states, restoring one gather and one scatter per
buffer for the states being restored, with one upload of row indices per ring count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.kv.pool import PooledState, StatePool
from deepinfer.kv.spec import KVBuffer, SlotBuffer

Upload = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class PoolCheckpoint:
    """Saved rows of some states (see the module docstring); :meth:`restore` puts some of them back."""

    pool: StatePool
    states: list[PooledState]
    num_tokens: list[int]
    #: Per ring count: every state's ring rows, ring-major per state, states one after the other (host) ...
    ring_rows: dict[int, torch.Tensor]
    #: ... and where each state's part starts (len(states) + 1 offsets).
    ring_offsets: dict[int, list[int]]
    saved: dict[str, torch.Tensor]  # buffer name -> the saved rows of every state (KV: ring rows; slot: [S, ...])
    upload: Upload

    def restore(self, indices: list[int]) -> None:
        """Return states ``indices`` (positions in the checkpoint) to what they were when it was taken."""
        if not indices:
            return
        picked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rings, rows in self.ring_rows.items():
            offsets = self.ring_offsets[rings]
            parts = [torch.arange(offsets[i], offsets[i + 1]) for i in indices]
            where = torch.cat(parts)
            both = self.upload(torch.stack([where, rows[where]]))
            picked[rings] = (both[0], both[1])
        slots = self.upload(torch.tensor([[i, self.states[i].slot or 0] for i in indices], dtype=torch.int64).T)
        for b in self.pool.spec.buffers:
            values = self.saved.get(b.name)
            if values is None:
                continue
            t = self.pool.tensors[b.name]
            if isinstance(b, KVBuffer):
                where, rows = picked[b.rings]
                t.index_copy_(0, rows, values[where])
            else:
                t.index_copy_(0, slots[1], values[slots[0]])
        for i in indices:
            self.states[i].num_tokens = self.num_tokens[i]


def _ring_rows(pool: StatePool, slot: int, rings: int, start: int, count: int) -> torch.Tensor:
    """Rows of positions ``start .. start + count - 1`` in every ring of ``slot`` (ring-major)."""
    ring = pool.spec.ring
    offsets = torch.arange(start, start + count) % ring + slot * ring
    return torch.cat([offsets + pool.ring_base(m) for m in range(rings)])


def checkpoint(states: list[PooledState], advances: list[int], upload: Upload | None = None) -> PoolCheckpoint:
    """Save what advancing each state by ``advances[i]`` tokens will overwrite.  Every state needs its slot
    (reserve first) and one pool.  ``upload``: host-to-device copy of index tensors (default ``.to(device)``)."""
    pool = states[0].pool
    send: Upload = upload if upload is not None else (lambda t: t.to(pool.device))
    for state in states:
        if state.pool is not pool or state.slot is None:
            raise ValueError("checkpoint: every state must hold a slot of one pool")
    ring_counts = sorted({b.rings for b in pool.spec.of(KVBuffer) if isinstance(b, KVBuffer) and b.rings})
    ring_rows, ring_offsets, device_rows = {}, {}, {}
    for rings in ring_counts:
        parts = [_ring_rows(pool, s.slot or 0, rings, s.num_tokens, min(m, pool.spec.ring))
                 for s, m in zip(states, advances, strict=True)]
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.numel())
        ring_rows[rings], ring_offsets[rings] = torch.cat(parts), offsets
        device_rows[rings] = send(ring_rows[rings])
    slots = send(torch.tensor([s.slot for s in states], dtype=torch.int64))
    saved = {}
    for b in pool.spec.buffers:
        t = pool.tensors[b.name]
        if isinstance(b, SlotBuffer):
            saved[b.name] = t[slots]
        elif isinstance(b, KVBuffer) and b.rings:
            saved[b.name] = t[device_rows[b.rings]]
    return PoolCheckpoint(pool, list(states), [s.num_tokens for s in states], ring_rows, ring_offsets, saved, send)

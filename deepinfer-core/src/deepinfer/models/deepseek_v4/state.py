"""V4's sequence state, pooled: what a chunk of new tokens needs from the tokens before it.

Every sequence owns one **slot** and, per compression ratio, a list of **pages**.  The memory lives in a
:class:`~.state_pool.StatePool` as a few device tensors per layer, so a decode step reads and writes state at
addresses that do not change from step to step (what CUDA graph replay needs), and nothing is concatenated or
reallocated per step.  Per layer:

- the SWA ring of the last ``sliding_window`` K=V latents (row ``slot * window + position % window``);
- for CSA / HCA layers, the compressor's carry-over in the slot (projections of the unfinished window's tokens
  at ``position % ratio``, and for CSA series a of the last closed window), and the compressed entries in pages
  (entry ``e`` at page ``pages[e // page_size]``, row ``e % page_size``);
- for CSA layers, the same for the lightning indexer's compressor, whose entries are the indexer keys.

A :class:`DeepseekV4State` itself is host-side bookkeeping only: its slot, its pages and its token count.
Feeding a prompt whole, in chunks or token by token leaves the same state behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.state_pool import StatePool


@dataclass(slots=True)
class LayerView:
    """One layer of one sequence's state as tensors (copies, in position order): for tests and debugging."""

    swa_ring: torch.Tensor  # [window, head_dim] rows by position % window
    entries: torch.Tensor | None  # [num_entries, head_dim]
    pending_kv: torch.Tensor | None  # [num_tokens % ratio, width]
    index_keys: torch.Tensor | None  # [num_entries, index_head_dim] (CSA)


@dataclass(slots=True, eq=False)
class DeepseekV4State:
    """All state of one sequence (implements :class:`deepinfer.models.base.SequenceState`).

    ``slot`` is ``None`` until the first forward; ``pages`` maps a compression ratio to the sequence's page
    ids in order.  The tensors are the pool's; :meth:`release` hands slot and pages back.
    """

    pool: StatePool
    slot: int | None = None
    pages: dict[int, list[int]] = field(default_factory=dict)
    num_tokens: int = 0

    @property
    def held_slot(self) -> int:
        """``slot`` of a state the pool has reserved (every state a forward or decode step sees)."""
        if self.slot is None:
            raise RuntimeError("this state holds no slot yet (StatePool.reserve gives it one)")
        return self.slot

    def nbytes(self) -> int:
        return self.pool.nbytes_of(self)

    def fork(self) -> DeepseekV4State:
        return self.pool.fork(self)

    def release(self) -> None:
        self.pool.release(self)

    def layer(self, index: int) -> LayerView:
        return self.pool.layer_view(self, index)

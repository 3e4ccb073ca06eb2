"""A sequence's state, pooled: host-side bookkeeping of where its rows live in a :class:`~.pool.StatePool`.

Every sequence owns one **slot** and, per compression ratio, a list of **pages**; the tensors are the pool's, so
a decode step reads and writes state at addresses that do not change from step to step (what CUDA graph replay
needs), and nothing is concatenated or reallocated per step.  Feeding a prompt whole, in chunks or token by token
leaves the same state behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.kv.pool import StatePool


@dataclass(slots=True, eq=False)
class PooledState:
    """All state of one sequence (implements :class:`deepinfer.models.base.SequenceState`).

    ``slot`` is ``None`` until the first forward; ``pages`` maps a compression ratio to the sequence's page
    ids in order.  :meth:`release` hands slot and pages back.  ``cached_tokens``: the entries of windows that
    end at or before this position came from the prefix cache (shared pages): a replay of those tokens
    recomputes its rings and carry-over but never writes those entries (:mod:`deepinfer.kv.prefix_cache`).
    """

    pool: StatePool
    slot: int | None = None
    pages: dict[int, list[int]] = field(default_factory=dict)
    num_tokens: int = 0
    cached_tokens: int = 0

    def nbytes(self) -> int:
        return self.pool.nbytes_of(self)

    def fork(self) -> PooledState:
        return self.pool.fork(self)

    def release(self) -> None:
        self.pool.release(self)

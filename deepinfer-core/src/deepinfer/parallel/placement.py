"""Where each MoE layer's experts live: physical expert slots, ``slots_per_rank`` per EP rank, each holding one
logical expert (a logical expert may hold several slots: redundant replicas).

Slot ``s`` of a layer lives on EP rank ``s // slots_per_rank``.  Plain data; EPLB (:mod:`.eplb`) computes new ones
from measured load, and :mod:`.rebalance` moves the weights to match.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ExpertPlacement:
    """``slots[layer][s]``: the logical expert in physical slot ``s`` of MoE layer ``layer``."""

    num_experts: int
    ep_size: int
    slots: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for layer, row in enumerate(self.slots):
            if len(row) % self.ep_size:
                raise ValueError(f"layer {layer}: {len(row)} expert slots do not divide over {self.ep_size} EP ranks")
            missing = set(range(self.num_experts)) - set(row)
            if missing or any(not 0 <= e < self.num_experts for e in row):
                raise ValueError(f"layer {layer}: every logical expert needs a slot and slots hold experts in "
                                 f"[0, {self.num_experts}); missing {sorted(missing)}, slots {list(row)}")

    @classmethod
    def round_robin(cls, num_layers: int, num_experts: int, ep_size: int, num_slots: int) -> ExpertPlacement:
        """Slot ``s`` holds expert ``s % num_experts``: experts in order, then replicas of the first ones."""
        row = tuple(s % num_experts for s in range(num_slots))
        return cls(num_experts, ep_size, (row,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.slots)

    @property
    def num_slots(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def local_experts(self, layer: int, ep_rank: int) -> tuple[int, ...]:
        """The logical experts of ``ep_rank``'s slots in ``layer``, in slot order."""
        n = self.slots_per_rank
        return self.slots[layer][ep_rank * n : (ep_rank + 1) * n]

    def replicas(self, layer: int) -> list[list[int]]:
        """Per logical expert, its physical slots (ascending)."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for s, e in enumerate(self.slots[layer]):
            out[e].append(s)
        return out

"""Helpers for the Engram placement tests: a backend whose host-resident tables are tensors of their own (as a
device reading host memory in place sees them), and a checkpoint reader that records what it reads."""

from __future__ import annotations

import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.models.checkpoint import SafetensorsCheckpoint


class ElsewhereBackend(CpuBackend):
    """``host_resident`` hands back a copy of each table and records it: the model must read what the backend
    hands back (the CPU backend's own ``host_resident`` is the table itself, which would prove nothing)."""

    def __init__(self) -> None:
        self.placed: list[torch.Tensor] = []

    def host_resident(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        assert t.device.type == "cpu" and t.is_contiguous(), "tables are read into host memory first"
        placed = t.clone()
        self.placed.append(placed)
        return placed


class RecordingCheckpoint(SafetensorsCheckpoint):
    """Records every read: ``(name, rows)``, rows None for a whole tensor."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.reads: list[tuple[str, slice | None]] = []

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        self.reads.append((name, rows))
        return super().get(name, rows)

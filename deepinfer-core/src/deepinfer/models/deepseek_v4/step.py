"""A decode step's inputs as device tensors of fixed shape: what a captured CUDA graph replays against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecodeStep:
    """One token for each of ``B`` sequences (padding rows use slot 0, position 0 and page 0)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64 state slot of each row
    page_tables: dict[int, torch.Tensor]  # compression ratio -> [B, pages] int64 page ids (0 = none)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "DecodeStep":
        """From the flat name -> tensor form the engine's graph runner keeps in static buffers."""
        tables = {int(name[6:]): t for name, t in tensors.items() if name.startswith("pages_")}
        return cls(tensors["input_ids"], tensors["positions"], tensors["slots"], tables)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "positions": self.positions, "slots": self.slots}
        out.update({f"pages_{r}": t for r, t in self.page_tables.items()})
        return out

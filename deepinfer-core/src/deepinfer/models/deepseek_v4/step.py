"""A decode step's inputs as device tensors of fixed shape: what a captured CUDA graph replays against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v4.state_pool import entry_rows


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


@dataclass(slots=True)
class RatioPlan:
    """Rows every layer of one compression ratio reads and writes in a decode step (computed once per step)."""

    pending_rows: torch.Tensor  # [B] row of the token in the slots' flattened carry-over: slot * ratio + pos % ratio
    closing: torch.Tensor  # [B] bool: the token closes its window, which becomes an entry
    has_previous: torch.Tensor  # [B] bool: a window closed before this one (CSA overlap is valid)
    entry_positions: torch.Tensor  # [B] first position of the window (the entry's RoPE position)
    entry_write: torch.Tensor  # [B] page row (relative to page 0) the entry goes to; 0 (null page) if not closing
    entry_write_kv: torch.Tensor  # entry_write as a row of the layer's KV pool (after the rings)
    entry_rows: torch.Tensor  # [B, pages * page_size] page row of every entry id the page table covers
    entry_cols: torch.Tensor  # [B, pages * page_size] the same as rows of the layer's KV pool
    #: [B, window + pages * page_size] the plan's window_cols, then entry_cols with -1 for entries not complete at
    #: the token: the keys of a layer that attends to every complete entry (HCA; CSA while its indexer picks all)
    causal_cols: torch.Tensor


@dataclass(slots=True)
class DecodePlan:
    """Index tensors shared by every layer of a decode step."""

    ring_rows: torch.Tensor  # [B] the token's SWA ring row: slot * window + pos % window
    window_cols: torch.Tensor  # [B, window] ring rows of the window ending at the token, -1 before position 0
    seq_ids: torch.Tensor  # [B] 0 .. B-1
    ratios: dict[int, RatioPlan]

    @classmethod
    def build(cls, step: DecodeStep, window: int, page_size: int, entry_base: int) -> "DecodePlan":
        """``entry_base``: the row of page 0 in every layer's KV pool (after the SWA rings)."""
        pos, slots = step.positions, step.slots
        key_pos = pos[:, None] + torch.arange(1 - window, 1, device=pos.device)[None, :]
        window_cols = torch.where(key_pos >= 0, slots[:, None] * window + key_pos % window, -1)
        ratios = {}
        for r, table in step.page_tables.items():
            entry = torch.clamp((pos + 1) // r - 1, min=0)  # the entry a closing window becomes
            closing = (pos + 1) % r == 0
            page_id = table.gather(1, (entry // page_size)[:, None])[:, 0]
            write = torch.where(closing, page_id * page_size + entry % page_size, 0)
            rows = entry_rows(table, page_size)
            cols = entry_base + rows
            complete = torch.arange(rows.shape[1], device=pos.device)[None, :] < ((pos + 1) // r)[:, None]
            ratios[r] = RatioPlan(slots * r + pos % r, closing, pos >= r, entry * r, write, entry_base + write,
                                  rows, cols, torch.cat([window_cols, torch.where(complete, cols, -1)], dim=1))
        seq_ids = torch.arange(pos.shape[0], device=pos.device)
        return cls(slots * window + pos % window, window_cols, seq_ids, ratios)

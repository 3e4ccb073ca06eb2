"""Where each sequence of a ragged batch lives: its rows in the flat batch and its chunk's first position."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.kv.ragged_plan import PrefillPlan


class BuiltOnUse(dict):
    """A dict whose missing keys are built on first use by ``build(key)``: a step's tables per compression ratio
    are made when the first layer of that ratio asks, by when the earlier layers' kernels are already queued, so
    the device does not sit idle while the host builds every table up front."""

    def __init__(self, build: Callable[[int], object]):
        super().__init__()
        self._build = build

    def __missing__(self, key: int) -> object:
        value = self[key] = self._build(key)
        return value


@dataclass(slots=True)
class RaggedLayout:
    offsets: list[int]  # first row of each sequence in the flat batch
    lens: list[int]  # new tokens of each sequence
    starts: list[int]  # absolute position of each sequence's first new token (its state's num_tokens)
    seq_ids: torch.Tensor  # [T] int64: sequence index of every row
    #: Per compression ratio, each sequence's page rows of its entries in order ([seqs, entries] int64 on the
    #: device, relative to page 0; set by the model once per step (a :class:`BuiltOnUse`) so no layer copies host
    #: data).
    entry_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Per compression ratio (0: sliding only), where that kind of layer finds its keys (set by the model, likewise).
    plans: dict[int, PrefillPlan] = field(default_factory=dict)
    #: Context parallelism: the rows whose attention output this rank computes (keys, states and every other
    #: row-wise input are every row's); None: every row.
    query_rows: torch.Tensor | None = None

    @classmethod
    def build(cls, seq_lens: list[int], starts: list[int],
              upload: Callable[[torch.Tensor], torch.Tensor]) -> RaggedLayout:
        """``upload`` moves a host tensor to the batch's device (``ForwardBatch.upload``: no blocking copy)."""
        offsets, total = [], 0
        for n in seq_lens:
            offsets.append(total)
            total += n
        lens = upload(torch.tensor(seq_lens, dtype=torch.int64))
        seq_ids = torch.repeat_interleave(  # output_size: the length is known here, so no device->host sync
            torch.arange(len(seq_lens), device=lens.device), lens, output_size=total
        )
        return cls(offsets, list(seq_lens), list(starts), seq_ids)

    def rows(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.lens[i])

    def __len__(self) -> int:
        return len(self.lens)

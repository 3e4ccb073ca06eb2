"""A ragged step's rows: where each sequence lives in the flat batch (its rows and its chunk's first position,
:class:`RaggedLayout`), and where every layer of one kind finds its keys (:class:`PrefillPlan`, built once per step
and compression ratio by :func:`deepinfer.kv.ragged_plan.prefill_plan`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


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
class WindowAssembly:
    """Rows (device int64) that build the windows a ragged step closes from the step's projections ``proj`` and
    the carry-over ``pending`` ([slots * ratio] rows, flattened), and update the carry-over: a window's ``ratio``
    slots are its sequence's held tokens (``pending``), then its new ones."""

    slot_src: torch.Tensor  # [N * ratio] proj row of each window slot (slots from pending: 0, then overwritten)
    held_dst: torch.Tensor  # [P] window slots that come from pending ...
    held_src: torch.Tensor  # [P] ... and their pending rows
    carry_dst: torch.Tensor  # [C] pending rows that take the tokens left after the last closed window ...
    carry_src: torch.Tensor  # [C] ... from these proj rows
    predecessor: torch.Tensor  # [N] the window before each in the step (a sequence's first: overwritten)
    first: torch.Tensor  # [M] each sequence's first closed window, whose predecessor is in ``overlap`` ...
    last: torch.Tensor  # [M] ... and its last, which ``overlap`` keeps
    slots: torch.Tensor  # [M] those sequences' state slots


@dataclass(slots=True)
class PrefillPlan:
    """Index tensors (on the device) every layer of one compression ratio (0: sliding only) shares in a step."""

    gather_rows: torch.Tensor  # [H] rows of a layer's kv tensor that precede the new latents in its pool
    window_cols: torch.Tensor  # [T, window] pool row of each key of the window ending at the query, -1 before 0
    entry_offsets: torch.Tensor | None  # [T] pool row of entry 0 of the query's sequence (compressed layers)
    #: [T, window + E] window_cols, then the pool rows of the entries complete at the query (else -1): the keys of
    #: a layer that attends to every complete entry (HCA, and CSA while its indexer picks all)
    causal_cols: torch.Tensor | None
    ring_rows: torch.Tensor  # [R] ring rows that take the step's newest latents (after every gather)
    ring_src: torch.Tensor  # [R] rows of the step's new latents that go there
    history_rows: int  # the first ``history_rows`` gather rows are ring rows (the rest: entries)
    #: The windows the step closes, in batch order (compressed layers; what every compressor of the ratio writes):
    closed_positions: torch.Tensor | None = None  # [N] each window's first position (its entry's RoPE position)
    closed_rows: torch.Tensor | None = None  # [N] page row (relative to page 0) its entry goes to
    closed_kv_rows: torch.Tensor | None = None  # closed_rows as rows of a layer's kv tensor (after the rings)
    #: [N] bool, false for a sequence's first window (CSA: no predecessor); None when every window has one
    closed_has_previous: torch.Tensor | None = None
    #: How the compressors of a many-sequence step assemble those windows without a loop over sequences
    #: (:meth:`Compressor._batched_windows`): None for the sliding-only plan.
    assembly: WindowAssembly | None = None

    def for_ring(self, base: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather rows, ring rows) when the layer's ring starts at row ``base`` of its KV buffer (a KV buffer
        with several rings: V4.1's groups) rather than row 0."""
        if base == 0:
            return self.gather_rows, self.ring_rows
        h = self.history_rows
        return torch.cat([self.gather_rows[:h] + base, self.gather_rows[h:]]), self.ring_rows + base


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

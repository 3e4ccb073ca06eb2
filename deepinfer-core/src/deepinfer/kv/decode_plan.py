"""A decode step's inputs as device tensors of fixed shape: what a captured CUDA graph replays against.

A plain decode step has one token per sequence.  A verify step (speculative decoding: each sequence's anchor and
its drafts, ``starts`` set) has ``q`` consecutive rows per sequence, each planned as its own query: every row
writes its ring row, entry and keys before any row reads (a ring holds ``q - 1`` spare rows, so no row a query
reads is overwritten), and a compressor takes a row's window from the step's rows and the slot's carry-over
(:class:`BlockWindows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.pool import entry_rows


@dataclass(slots=True)
class DecodeStep:
    """One token for each of ``B`` rows (padding rows use slot 0, position 0 and page 0): one sequence a row, or
    (a verify step) ``q`` consecutive rows a sequence at consecutive positions from ``starts``."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64 state slot of each row
    page_tables: dict[int, torch.Tensor]  # compression ratio -> [B, pages] int64 page ids (0 = none)
    starts: torch.Tensor | None = None  # [B] int64: the position of the row's sequence's first row (verify steps)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> DecodeStep:
        """From the flat name -> tensor form the engine's graph runner keeps in static buffers."""
        tables = {int(name[6:]): t for name, t in tensors.items() if name.startswith("pages_")}
        return cls(tensors["input_ids"], tensors["positions"], tensors["slots"], tables, tensors.get("starts"))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "positions": self.positions, "slots": self.slots}
        if self.starts is not None:
            out["starts"] = self.starts
        out.update({f"pages_{r}": t for r, t in self.page_tables.items()})
        return out


@dataclass(slots=True, frozen=True)
class RatioKinds:
    """What the layers of one compression ratio read from a decode plan (plain data from the model config)."""

    overlap: bool = False  # an overlapping compressor (V4's CSA): has_previous, overlap_slots
    indexed: bool = False  # an indexer picks entries (V4's CSA; every V4.1 compressed layer): picks, pick_cols
    attends_all: bool = False  # a layer attends to every complete entry (V4's HCA): causal_cols


@dataclass(slots=True)
class CausalPicks:
    """Every entry complete at a query, as top-k picks: what a CSA indexer takes instead of its scores' top-k
    where no more than ``topk`` entries are complete (they are all picked, in order)."""

    limits: torch.Tensor  # [T] entries complete at the query (pooling only tokens <= it): the causal limit
    takes_all: torch.Tensor  # [T, 1] bool: no more than topk entries are complete
    ids: torch.Tensor  # [T, topk] entry ids 0 .. limit - 1, then -1

    @classmethod
    def build(cls, limits: torch.Tensor, counting: torch.Tensor) -> CausalPicks:
        """``counting``: ``0 .. topk - 1`` on the device."""
        ids = torch.where(counting < limits[:, None], counting, -1)
        return cls(limits, (limits <= counting.shape[0])[:, None], ids)


@dataclass(slots=True)
class BlockWindows:
    """Where a verify step's compressor finds each row's window (``ratio`` tokens ending at the row's window
    end): token ``i`` is the step's row ``step_rows[:, i]`` where ``from_step``, else the slot's carry-over row
    ``pending_rows[:, i]`` (flattened ``[slots * ratio]``).  Tokens after the row are its own row: only a closing
    row's window (the row is its last token) becomes an entry."""

    step_rows: torch.Tensor  # [T, ratio]
    pending_rows: torch.Tensor  # [T, ratio]
    from_step: torch.Tensor  # [T, ratio] bool

    @classmethod
    def build(cls, positions: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
              counting: torch.Tensor) -> BlockWindows:
        """``rows``: ``0 .. T - 1``; ``counting``: ``0 .. ratio - 1`` (on the device)."""
        ratio = counting.shape[0]
        back = (positions % ratio)[:, None] - counting  # token i is this many positions before the row
        offset = (positions - starts)[:, None]  # the row's index in its sequence's block
        step_rows = (rows[:, None] - back.clamp(min=0)).clamp(min=0)
        return cls(step_rows, torch.add(counting, slots[:, None], alpha=ratio), back <= offset)


@dataclass(slots=True)
class RatioPlan:
    """Rows every layer of one compression ratio reads and writes in a decode step (computed once per step)."""

    pending_rows: torch.Tensor  # [B] row of the token in the slots' flattened carry-over: slot * ratio + pos % ratio
    closing: torch.Tensor  # [B] bool: the token closes its window, which becomes an entry
    entry_positions: torch.Tensor  # [B] first position of the token's window (a closing one's entry RoPE position)
    entry_write: torch.Tensor  # [B] page row (relative to page 0) the entry goes to; 0 (null page) if not closing
    entry_rows: torch.Tensor  # [B, pages * page_size] page row of every entry id the page table covers
    # ratios with an overlapping compressor (V4's CSA), else None:
    has_previous: torch.Tensor | None  # [B] bool: a window closed before this one (the overlap is valid)
    overlap_slots: torch.Tensor | None  # [B] the slot a closing window's series a goes to; 0 (null slot) if not closing
    #: [B, window + pages * page_size] the plan's window_cols, then every entry's KV pool row with -1 for entries
    #: not complete at the token: the keys of a layer that attends to every complete entry (HCA; CSA while the
    #: bucket holds no more entries than its indexer picks); None where no layer of the ratio does
    causal_cols: torch.Tensor | None
    #: [B, pages * page_size] the entry part of causal_cols (every entry's KV pool row, -1 where not complete),
    #: for layers whose window columns are offset (a second ring of a KV buffer); None when causal_cols is
    causal_entries: torch.Tensor | None
    #: CSA while its indexer picks from more entries than it keeps, else None: what it takes where no more than
    #: top-k entries are complete, and [B, pages * page_size + 1] every entry's KV pool row then -1, the key
    #: column of each pick (a pick of -1 reads the last column)
    picks: CausalPicks | None
    pick_cols: torch.Tensor | None
    #: A verify step's compressor windows (ratio > 1), else None
    block: BlockWindows | None = None


@dataclass(slots=True)
class DecodePlan:
    """Index tensors shared by every layer of a decode step."""

    ring_rows: torch.Tensor  # [B] the token's SWA ring row: slot * ring + pos % ring
    window_cols: torch.Tensor  # [B, window] ring rows of the window ending at the token, -1 before position 0
    seq_ids: torch.Tensor  # [B] 0 .. B-1
    ratios: dict[int, RatioPlan]

    @classmethod
    def build(cls, step: DecodeStep, window: int, page_size: int, entry_base: dict[int, int], index_topk: int,
              kinds: dict[int, RatioKinds], ring: int | None = None) -> DecodePlan:
        """``ring``: rows of a slot's ring (``StateSpec.ring``; None: ``window``); ``entry_base``: per ratio, the
        row of page 0 in its layers' KV pools (after the SWA rings);
        ``index_topk``: the indexers'; ``kinds``: what each ratio's layers read.  Each op here is one kernel node
        of a step's graph: built once, read by every layer."""
        pos, slots, batch = step.positions, step.slots, step.positions.shape[0]
        widths = [t.shape[1] * page_size for t in step.page_tables.values()]
        ints = _Ints(min(1 - window, -1), max(batch, page_size, index_topk, *widths), pos.device)
        key_pos = pos[:, None] + ints(1 - window, 1)
        ring = ring or window
        ring_at = torch.add(key_pos % ring, slots[:, None], alpha=ring)  # slot * ring + key_pos % ring
        window_cols = torch.where(key_pos >= 0, ring_at, -1)
        seq_ids, after = ints(0, batch), pos + 1
        ratios = {}
        for r, table in step.page_tables.items():
            within = pos % r  # the token's place in its window
            closing = within == r - 1
            complete = after // r  # entries complete at the token
            rows = entry_rows(table, page_size, ints(0, page_size))
            cols = rows + entry_base[r]
            kind = kinds[r]
            # a closing window's entry is the last complete one (-1 wraps to the last column: never written)
            write = torch.where(closing, rows[seq_ids, complete - 1], 0)
            has_previous = overlap_slots = causal = causal_cols = picks = pick_cols = None
            picking = kind.indexed and cols.shape[1] > index_topk  # it picks from more entries than it keeps
            if kind.overlap:
                has_previous, overlap_slots = pos >= r, torch.where(closing, slots, 0)
            if picking:
                picks = CausalPicks.build(complete, ints(0, index_topk))
                pick_cols = torch.cat([cols, ints(-1, 0).expand(batch, 1)], dim=1)
            if kind.attends_all or not picking:
                causal = torch.where(ints(0, cols.shape[1]) < complete[:, None], cols, -1)
                causal_cols = torch.cat([window_cols, causal], dim=1)
            block = None
            if step.starts is not None and r > 1:
                block = BlockWindows.build(pos, step.starts, slots, seq_ids, ints(0, r))
            ratios[r] = RatioPlan(torch.add(within, slots, alpha=r), closing, pos - within, write, rows,
                                  has_previous, overlap_slots, causal_cols, causal, picks, pick_cols, block)
        # the token's own ring row is the window's last column (contiguous: every layer's ring write reads it)
        return cls(ring_at[:, -1].contiguous(), window_cols, seq_ids, ratios)


class _Ints:
    """Runs of integers ``a .. b - 1`` as views of one ``arange``: one kernel for all a plan needs."""

    def __init__(self, lo: int, hi: int, device: torch.device):
        self.lo, self.values = lo, torch.arange(lo, hi, device=device)

    def __call__(self, a: int, b: int) -> torch.Tensor:
        return self.values[a - self.lo : b - self.lo]

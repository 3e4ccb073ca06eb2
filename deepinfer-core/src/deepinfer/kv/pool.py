"""The memory behind every sequence's state: the buffers of a :class:`~.spec.StateSpec`, indexed by slot and page,
and the :class:`PooledState` handles that say where one sequence's rows live in them.

Slot 0 and page 0 of every ratio are never handed out: padding rows of a decode batch (CUDA graph buckets) and
compressor windows that do not close this step write there, so the decode step needs no data-dependent branch.

A pool is either **fixed** (the engine sizes it once from its byte budget, so addresses never change and decode
steps can be captured) or **growable** (tests and tools: slots and pages double on demand, moving the data).
The pool knows buffers by kind and name only; what a model reads through them it builds with ``views``
(rebuilt whenever the tensors move).

Pages are reference-counted: a page of compressed entries is written once per entry, so the prefix cache
(:mod:`.prefix_cache`) and every sequence that hits it hold the same page (:meth:`StatePool.retain`,
:meth:`StatePool.attach`); a page returns to the free list when its last holder lets go.  When a fixed pool runs
out of slots or pages it first asks ``reclaim`` (the prefix cache's LRU eviction) to free some.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.kv.sizing import PoolPlan, plan_pool
from deepinfer.kv.spec import Buffer, KVBuffer, PageBuffer, RowFormat, SlotBuffer, StateSpec, entries_name


@dataclass(slots=True, eq=False)
class PooledState:
    """All state of one sequence (implements :class:`deepinfer.models.base.SequenceState`): host-side bookkeeping
    of where its rows live in its :class:`StatePool`.

    Every sequence owns one **slot** (``None`` until the first forward) and, per compression ratio, a list of
    **pages** (its page ids in order); the tensors are the pool's, so a decode step reads and writes state at
    addresses that do not change from step to step (what CUDA graph replay needs), and nothing is concatenated or
    reallocated per step.  Feeding a prompt whole, in chunks or token by token leaves the same state behind.
    :meth:`release` hands slot and pages back.  ``cached_tokens``: the entries of windows that end at or before
    this position came from the prefix cache (shared pages): a replay of those tokens recomputes its rings and
    carry-over but never writes those entries (:mod:`deepinfer.kv.prefix_cache`).
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


def padded_pages(states: list[PooledState], ratio: int, width: int) -> list[int]:
    """Every sequence's page ids for ``ratio``, each padded to ``width`` with the null page 0, in one list."""
    values: list[int] = []
    for state in states:
        ids = state.pages.get(ratio, ())
        if len(ids) > width:
            raise ValueError(f"a sequence holds {len(ids)} pages of ratio {ratio}; the table has {width} columns")
        values += ids
        values += [0] * (width - len(ids))
    return values


def entry_rows(table: torch.Tensor, page_size: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Rows (relative to page 0) of every entry id a page table ``[seqs, pages]`` covers: ``[seqs, pages *
    page_size]``, entry ``e`` of a sequence at page ``table[e // page_size]``, row ``e % page_size``.
    ``offsets``: ``0 .. page_size - 1`` on the table's device, if the caller has them (one launch less)."""
    if offsets is None:
        offsets = torch.arange(page_size, device=table.device)
    return torch.add(offsets, table[:, :, None], alpha=page_size).flatten(1)  # one launch for table * size + offset


class StatePool:
    """Slots and pages of every buffer (see the module docstring).  ``views(pool)`` builds what the model reads
    (e.g. per-layer caches of the tensors): :attr:`views`, rebuilt when the pool grows."""

    def __init__(self, spec: StateSpec, dtype: torch.dtype, device: torch.device, *, slots: int,
                 pages: dict[int, int], growable: bool, views: Callable[[StatePool], Any] | None = None):
        self.spec, self.dtype, self.device, self.growable = spec, dtype, torch.device(device), growable
        self.ratios = spec.paged_ratios  # compression ratios with pages, ascending
        self.slots = max(2, slots)
        self.pages = {r: max(2, pages.get(r, 0)) for r in spec.paged_ratios}
        rings: dict[int, int] = {}
        for b in spec.of(KVBuffer):
            assert isinstance(b, KVBuffer)
            if b.ratio and rings.setdefault(b.ratio, b.rings) != b.rings:
                raise ValueError(f"KV buffers of ratio {b.ratio} must have equal ring counts (their pages start at "
                                 f"one row): {b.name} has {b.rings}, another {rings[b.ratio]}")
        self._rings = rings
        self.tensors = self._allocate()
        self._free_slots = list(range(self.slots - 1, 0, -1))
        self._free_pages = {r: list(range(n - 1, 0, -1)) for r, n in self.pages.items()}
        self._refs: dict[int, dict[int, int]] = {r: {} for r in self.ratios}  # holders of each page handed out
        #: Called when a fixed pool has no free slot or page: frees some (True) or has nothing left (False).
        self.reclaim: Callable[[], bool] | None = None
        self.slot_bytes, self.page_bytes = spec.byte_sizes(torch.empty(0, dtype=dtype).element_size())
        self._make_views = views
        self.views: Any = views(self) if views is not None else None

    # --- sizing -------------------------------------------------------------------------------------
    @classmethod
    def for_budget(cls, spec: StateSpec, dtype: torch.dtype, device: torch.device, max_seqs: int,
                   capacity_bytes: int, views: Callable[[StatePool], Any] | None = None) -> tuple[StatePool, PoolPlan]:
        """A fixed pool within ``capacity_bytes``, and its plan: how many sequences may be live at once
        (``slots - 1``) and the bytes of ``state_bytes`` they may reserve in all."""
        plan = plan_pool(spec, torch.empty(0, dtype=dtype).element_size(), max_seqs, capacity_bytes)
        return cls(spec, dtype, device, slots=plan.slots, pages=plan.pages, growable=False, views=views), plan

    @classmethod
    def growable_pool(cls, spec: StateSpec, dtype: torch.dtype, device: torch.device,
                      views: Callable[[StatePool], Any] | None = None) -> StatePool:
        return cls(spec, dtype, device, slots=4, pages={r: 4 for r in spec.paged_ratios}, growable=True,
                   views=views)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def live(self) -> int:
        """Sequences holding a slot."""
        return self.slots - 1 - len(self._free_slots)

    # --- layout -------------------------------------------------------------------------------------
    def _rows(self, rows: int, fmt: RowFormat | None, b: KVBuffer | PageBuffer
              ) -> tuple[tuple[int, ...], torch.dtype]:
        if fmt is not None:  # packed bytes
            return (rows, fmt.row_bytes(b.width)), torch.uint8
        return (rows, b.width), b.dtype or self.dtype

    def _tensors_of(self, b: Buffer) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors holding buffer ``b``: name -> (shape, dtype)."""
        if isinstance(b, SlotBuffer):
            return {b.name: ((self.slots, *b.shape), b.dtype or self.dtype)}
        entries = self.pages.get(b.ratio, 0) * self.spec.page_size if b.ratio else 0
        if isinstance(b, PageBuffer):
            return {b.name: self._rows(entries, b.format, b)}
        rings = b.rings * self.slots * self.spec.ring
        if b.split:
            return {b.name: self._rows(rings, b.ring_format, b), entries_name(b.name): self._rows(entries,
                                                                                                b.entry_format, b)}
        return {b.name: self._rows(rings + entries, b.ring_format, b)}

    def _allocate(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=dtype, device=self.device)
                for b in self.spec.buffers for name, (shape, dtype) in self._tensors_of(b).items()}

    def _entries(self, b: KVBuffer | PageBuffer, tensors: dict[str, torch.Tensor], base: int
                 ) -> tuple[torch.Tensor, int]:
        """(the tensor holding ``b``'s entries, the row of page 0 in it), ``base``: a joint KV buffer's."""
        if isinstance(b, KVBuffer):
            return (tensors[entries_name(b.name)], 0) if b.split else (tensors[b.name], base)
        return tensors[b.name], 0

    def entry_base(self, ratio: int) -> int:
        """Row of page 0 in every KV buffer of ``ratio`` (its rings come first)."""
        return self._rings.get(ratio, 1) * self.slots * self.spec.ring

    def ring_base(self, member: int) -> int:
        """Row of ring ``member``'s slot 0 in a KV buffer."""
        return member * self.slots * self.spec.ring

    # --- sequences ----------------------------------------------------------------------------------
    def new_state(self) -> PooledState:
        return PooledState(self)

    def reserve(self, state: PooledState, num_tokens: int) -> None:
        """Give ``state`` a slot and the pages its entries need once it holds ``num_tokens`` tokens."""
        if state.slot is None:
            state.slot = self._take_slot()
        for r in self.ratios:
            have = state.pages.setdefault(r, [])
            while len(have) < self.spec.pages_for(num_tokens, r):
                have.append(self._take_page(r))

    def release(self, state: PooledState) -> None:
        if state.slot is not None:
            self._free_slots.append(state.slot)
        for r, ids in state.pages.items():
            self.drop(r, ids)
        state.slot, state.pages, state.num_tokens, state.cached_tokens = None, {}, 0, 0

    # --- shared pages -------------------------------------------------------------------------------
    def retain(self, ratio: int, ids: list[int]) -> None:
        """One more holder of each page in ``ids`` (the prefix cache, or a sequence that hit it)."""
        refs = self._refs[ratio]
        for i in ids:
            refs[i] += 1

    def drop(self, ratio: int, ids: list[int]) -> None:
        """One holder less of each page in ``ids``; a page nobody holds is free again."""
        refs, free = self._refs[ratio], self._free_pages[ratio]
        for i in reversed(ids):
            refs[i] -= 1
            if not refs[i]:
                del refs[i]
                free.append(i)

    def holders(self, ratio: int, page: int) -> int:
        return self._refs[ratio].get(page, 0)

    def attach(self, state: PooledState, pages: dict[int, list[int]], num_tokens: int) -> None:
        """Give the empty ``state`` a slot and the entries of the first ``num_tokens`` tokens from ``pages``
        (per ratio, the page ids that hold them in order): full pages are shared, the last partly filled page
        is copied into a page of its own (the sequence writes its next entries there).  Rings and carry-over
        are not copied: the caller replays tokens to rebuild them."""
        if state.slot is not None or state.pages:
            raise ValueError("attach: the state already holds a slot or pages")
        state.slot = self._take_slot()
        for r in self.ratios:
            entries = num_tokens // r
            full, rest = divmod(entries, self.spec.page_size)
            shared = pages.get(r, [])[:full]
            self.retain(r, shared)
            state.pages[r] = list(shared)
            if rest:
                page = self._take_page(r)
                state.pages[r].append(page)
                self._copy_page(r, pages[r][full], page, rest)
        state.cached_tokens = num_tokens

    def _copy_page(self, ratio: int, src: int, dst: int, rows: int) -> None:
        """The first ``rows`` entries of page ``src`` into page ``dst``, in every buffer with pages of ``ratio``."""
        size = self.spec.page_size
        for b in self.spec.buffers:
            if isinstance(b, SlotBuffer) or b.ratio != ratio:
                continue
            base = self.entry_base(ratio) if isinstance(b, KVBuffer) else 0
            t = self.tensors[b.name]
            t[base + dst * size : base + dst * size + rows] = t[base + src * size : base + src * size + rows]

    def fork(self, state: PooledState) -> PooledState:
        """A copy of ``state`` in its own slot and pages."""
        child = PooledState(self, num_tokens=state.num_tokens, cached_tokens=state.cached_tokens)
        if state.slot is None:
            return child
        self.reserve(child, state.num_tokens)
        src, dst = state.slot, child.slot
        assert dst is not None
        for b in self.spec.buffers:
            t = self.tensors[b.name]
            if isinstance(b, SlotBuffer):
                t[dst] = t[src]
                continue
            if isinstance(b, KVBuffer):
                for m in range(b.rings):
                    t[self.ring_rows(dst, m)] = t[self.ring_rows(src, m)]
            if b.ratio:
                t, base = self._entries(b, self.tensors, self.entry_base(b.ratio))
                t[base + self.page_rows(child, b.ratio)] = t[base + self.page_rows(state, b.ratio)]
        return child

    def nbytes_of(self, state: PooledState) -> int:
        if state.slot is None:
            return 0
        return self.slot_bytes + sum(len(ids) * self.page_bytes[r] for r, ids in state.pages.items())

    # --- addressing ---------------------------------------------------------------------------------
    def ring_rows(self, slot: int, member: int = 0) -> torch.Tensor:
        w = self.spec.ring
        start = self.ring_base(member) + slot * w
        return torch.arange(start, start + w, device=self.device)

    def page_rows(self, state: PooledState, ratio: int) -> torch.Tensor:
        """Rows (relative to page 0) of every page ``state`` holds for ``ratio``, in entry order."""
        table = torch.tensor([state.pages.get(ratio, [])], dtype=torch.int64)
        return entry_rows(table, self.spec.page_size)[0].to(self.device)

    def page_table(self, states: list[PooledState], ratio: int, width: int) -> torch.Tensor:
        """Host int64 ``[len(states), width]`` page ids per sequence, padded with the null page 0."""
        return torch.tensor(padded_pages(states, ratio, width), dtype=torch.int64).view(len(states), width)

    # --- allocation ---------------------------------------------------------------------------------
    def _reclaim_until(self, free: list[int]) -> None:
        while not free and self.reclaim is not None and self.reclaim():
            pass

    def _take_slot(self) -> int:
        if not self._free_slots:
            if not self.growable:
                raise RuntimeError(f"state pool has no free slot (all {self.slots - 1} in use)")
            self._grow(slots=2 * self.slots)
        return self._free_slots.pop()

    def _take_page(self, ratio: int) -> int:
        self._reclaim_until(self._free_pages[ratio])
        if not self._free_pages[ratio]:
            if not self.growable:
                raise RuntimeError(f"state pool has no free page for compression ratio {ratio} "
                                   f"(all {self.pages[ratio] - 1} in use)")
            self._grow(pages={**self.pages, ratio: 2 * self.pages[ratio]})
        page = self._free_pages[ratio].pop()
        self._refs[ratio][page] = 1
        return page

    def _grow(self, slots: int | None = None, pages: dict[int, int] | None = None) -> None:
        """Reallocate every buffer with more slots or pages, keeping the contents (growable pools only)."""
        old_slots, old_pages, old = self.slots, dict(self.pages), self.tensors
        old_base = {r: self.entry_base(r) for r in self.ratios}
        self.slots = slots or self.slots
        self.pages = pages or self.pages
        self.tensors = self._allocate()
        ring, page = self.spec.ring, self.spec.page_size
        for b in self.spec.buffers:
            a, t = old[b.name], self.tensors[b.name]
            if isinstance(b, SlotBuffer):
                t[:old_slots] = a
                continue
            if isinstance(b, KVBuffer):
                for m in range(b.rings):
                    rows = old_slots * ring
                    t[self.ring_base(m) : self.ring_base(m) + rows] = a[m * rows : (m + 1) * rows]
            if b.ratio:
                n = old_pages[b.ratio] * page
                a, src = self._entries(b, old, old_base[b.ratio])
                t, dst = self._entries(b, self.tensors, self.entry_base(b.ratio))
                t[dst : dst + n] = a[src : src + n]
        self._free_slots = list(range(self.slots - 1, old_slots - 1, -1)) + self._free_slots
        for r, n in self.pages.items():
            self._free_pages[r] = list(range(n - 1, old_pages[r] - 1, -1)) + self._free_pages[r]
        if self._make_views is not None:
            self.views = self._make_views(self)

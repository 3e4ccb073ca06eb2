"""The memory behind every V4 sequence's state: per-layer device tensors indexed by slot and page.

Slot 0 and page 0 of every ratio are never handed out: padding rows of a decode batch (CUDA graph buckets) and
compressor windows that do not close this step write there, so the decode step needs no data-dependent branch.

A pool is either **fixed** (the engine sizes it once from its byte budget, so addresses never change and decode
steps can be captured) or **growable** (tests and tools: slots and pages double on demand, moving the data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.state import DeepseekV4State, LayerView

#: Compressed entries per page.
PAGE_SIZE = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class StateSpec:
    """Shapes of one sequence's state, from the model config (plain ints)."""

    window: int
    head_dim: int
    index_head_dim: int
    kinds: tuple[str, ...]
    ratios: tuple[int, ...]  # per layer; 0 for sliding layers
    page_size: int = PAGE_SIZE
    #: (slot elements, {ratio: page elements}): computed once, since the scheduler asks for sizes every step
    sizes: tuple[int, dict[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", (self.slot_elems(), {r: self.page_elems(r) for r in self.paged_ratios}))

    @classmethod
    def from_config(cls, cfg: DeepseekV4Config) -> StateSpec:
        return cls(cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, tuple(cfg.layer_types),
                   tuple(0 if k == SLIDING else r for k, r in zip(cfg.layer_types, cfg.compress_ratios, strict=True)))

    @property
    def paged_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.ratios if r}))

    def pages_for(self, num_tokens: int, ratio: int) -> int:
        """Pages holding the entries of ``num_tokens`` tokens (one per closed window of ``ratio``)."""
        return _ceil_div(num_tokens // ratio, self.page_size)

    def _compressor_elems(self, ratio: int, dim: int, overlap: bool) -> int:
        width = 2 * dim if overlap else dim
        return 2 * ratio * width + (2 * ratio * dim if overlap else 0)  # kv + gate carry-over, CSA overlap

    def slot_elems(self) -> int:
        """Elements of one slot over all layers: SWA ring and compressor carry-over."""
        total = 0
        for kind, ratio in zip(self.kinds, self.ratios, strict=True):
            total += self.window * self.head_dim
            if ratio:
                total += self._compressor_elems(ratio, self.head_dim, kind == CSA)
            if kind == CSA:
                total += self._compressor_elems(ratio, self.index_head_dim, True)
        return total

    def page_elems(self, ratio: int) -> int:
        """Elements of one page of ``ratio`` over all its layers: entries (and CSA indexer keys)."""
        per_entry = sum(self.head_dim + (self.index_head_dim if k == CSA else 0)
                        for k, r in zip(self.kinds, self.ratios, strict=True) if r == ratio)
        return self.page_size * per_entry

    def byte_sizes(self, element_size: int) -> tuple[int, dict[int, int]]:
        """(bytes of one slot, {ratio: bytes of one page}) at ``element_size`` bytes per element."""
        slot, pages = self.sizes
        return slot * element_size, {r: n * element_size for r, n in pages.items()}

    def state_elems(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        slot, pages = self.sizes
        return slot + sum(self.pages_for(num_tokens, r) * elems for r, elems in pages.items())


@dataclass(slots=True, frozen=True)
class PoolPlan:
    slots: int  # including the null slot 0
    pages: dict[int, int]  # per ratio, including the null page 0
    admissible: int  # bytes of state_bytes() the scheduler may reserve in all
    nbytes: int  # bytes the pool allocates


def _plan_for(spec: StateSpec, size: int, live: int, capacity: int) -> PoolPlan | None:
    """The pool for at most ``live`` sequences within ``capacity`` bytes, or None if it does not fit.

    Any set of at most ``live`` sequences whose ``state_bytes`` sum to at most ``admissible`` fits: each holds
    a slot, and per ratio the pages of ``T`` tokens in all plus one partly filled page per sequence, where ``T``
    bounds the tokens that many reserved bytes can describe (entries are ``floor(n / ratio)``, hence the slack).
    """
    ratios = spec.paged_ratios
    slot_bytes, page_bytes = spec.byte_sizes(size)
    per_token = sum(page_bytes[r] / (r * spec.page_size) for r in ratios)
    slack_tokens = live * sum(page_bytes[r] / spec.page_size for r in ratios) / per_token if ratios else 0.0

    def pages_for(admissible: int) -> dict[int, int]:
        tokens = int(admissible / per_token + slack_tokens) + 1 if ratios else 0
        return {r: _ceil_div(tokens, r * spec.page_size) + live + 1 for r in ratios}

    def total(admissible: int) -> int:
        return (live + 1) * slot_bytes + sum(n * page_bytes[r] for r, n in pages_for(admissible).items())

    admissible = capacity - total(0)
    while admissible > 0 and total(admissible) > capacity:
        admissible -= max(1, total(admissible) - capacity)
    if admissible < slot_bytes or admissible <= 0:
        return None
    return PoolPlan(live + 1, pages_for(admissible), admissible, total(admissible))


def plan_pool(spec: StateSpec, size: int, max_seqs: int, capacity: int) -> PoolPlan:
    """The pool for ``capacity`` bytes: at most ``max_seqs`` slots, fewer when their fixed cost (a slot and a
    partly filled page per ratio each) would take more than half the budget; the rest holds pages."""
    slot_bytes, page_bytes = spec.byte_sizes(size)
    fixed = slot_bytes + sum(page_bytes.values())
    live = max(1, min(max_seqs, capacity // (2 * max(1, fixed))))
    plan = _plan_for(spec, size, live, capacity)
    if plan is None:
        least = 2 * slot_bytes + 3 * sum(page_bytes.values())
        raise ValueError(f"a state cache budget of {capacity} bytes cannot hold one sequence of this model "
                         f"(more than {least} bytes: its slot and pages, and the pool's null slot and pages): "
                         "raise state_cache_bytes")
    return plan


def pool_bytes_for(spec: StateSpec, size: int, max_seqs: int, num_tokens: int) -> int:
    """The smallest budget (within 0.1%) whose :func:`plan_pool` has ``max_seqs`` slots and admits
    ``max_seqs`` sequences of ``num_tokens`` tokens each."""
    want = max_seqs * spec.state_elems(num_tokens) * size

    def enough(capacity: int) -> bool:
        try:
            plan = plan_pool(spec, size, max_seqs, capacity)
        except ValueError:
            return False
        return plan.slots - 1 >= max_seqs and plan.admissible >= want

    lo, hi = 0, max(1, 2 * want)
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def padded_pages(states: list[DeepseekV4State], ratio: int, width: int) -> list[int]:
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


class CompressorCache:
    """One compressor's carry-over for every slot: ``pending`` [slots, ratio, 2 * width] holds the unfinished
    window's projections (kv, then gate, side by side: one write and one read per step); ``overlap``
    [slots, ratio, 2 * dim] series a of the last closed window's kv and gate (CSA only)."""

    __slots__ = ("pending", "overlap")

    def __init__(self, slots: int, ratio: int, dim: int, overlap: bool, dtype: torch.dtype, device: torch.device):
        width = 2 * dim if overlap else dim
        self.pending = torch.zeros(slots, ratio, 2 * width, dtype=dtype, device=device)
        self.overlap = torch.zeros(slots, ratio, 2 * dim, dtype=dtype, device=device) if overlap else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.pending, self.overlap) if t is not None]


class LayerCache:
    """One layer's state for every slot and page.

    ``kv`` holds the SWA rings (rows ``[0, slots * window)``) and then the compressed entries' pages, so one
    tensor is the pool sparse attention gathers from.  ``index_keys`` holds the CSA indexer keys' pages.
    """

    __slots__ = ("kind", "ratio", "kv", "compressor", "index_keys", "indexer")

    def __init__(self, spec: StateSpec, layer: int, slots: int, pages: dict[int, int], dtype: torch.dtype,
                 device: torch.device):
        self.kind, self.ratio = spec.kinds[layer], spec.ratios[layer]
        n_pages = pages.get(self.ratio, 0)
        self.kv = torch.zeros(slots * spec.window + n_pages * spec.page_size, spec.head_dim, dtype=dtype,
                              device=device)
        self.compressor = self.index_keys = self.indexer = None
        if self.ratio:
            self.compressor = CompressorCache(slots, self.ratio, spec.head_dim, self.kind == CSA, dtype, device)
        if self.kind == CSA:
            self.indexer = CompressorCache(slots, self.ratio, spec.index_head_dim, True, dtype, device)
            self.index_keys = torch.zeros(n_pages * spec.page_size, spec.index_head_dim, dtype=dtype, device=device)


class StatePool:
    """Slots and pages of every layer's state (see the module docstring)."""

    def __init__(self, spec: StateSpec, dtype: torch.dtype, device: torch.device, *, slots: int,
                 pages: dict[int, int], growable: bool):
        self.spec, self.dtype, self.device, self.growable = spec, dtype, torch.device(device), growable
        self.ratios = spec.paged_ratios  # compression ratios with pages, ascending
        self.slots = max(2, slots)
        self.pages = {r: max(2, pages.get(r, 0)) for r in spec.paged_ratios}
        self.layers = [LayerCache(spec, i, self.slots, self.pages, dtype, self.device) for i in range(len(spec.kinds))]
        self._free_slots = list(range(self.slots - 1, 0, -1))
        self._free_pages = {r: list(range(n - 1, 0, -1)) for r, n in self.pages.items()}
        self.slot_bytes, self.page_bytes = spec.byte_sizes(torch.empty(0, dtype=dtype).element_size())

    # --- sizing -------------------------------------------------------------------------------------
    @classmethod
    def for_budget(cls, spec: StateSpec, dtype: torch.dtype, device: torch.device, max_seqs: int,
                   capacity_bytes: int) -> tuple[StatePool, PoolPlan]:
        """A fixed pool within ``capacity_bytes``, and its plan: how many sequences may be live at once
        (``slots - 1``) and the bytes of ``state_bytes`` they may reserve in all."""
        plan = plan_pool(spec, torch.empty(0, dtype=dtype).element_size(), max_seqs, capacity_bytes)
        return cls(spec, dtype, device, slots=plan.slots, pages=plan.pages, growable=False), plan

    @classmethod
    def growable_pool(cls, spec: StateSpec, dtype: torch.dtype, device: torch.device) -> StatePool:
        return cls(spec, dtype, device, slots=4, pages={r: 4 for r in spec.paged_ratios}, growable=True)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in _layer_tensors(layer))

    @property
    def live(self) -> int:
        """Sequences holding a slot."""
        return self.slots - 1 - len(self._free_slots)

    # --- sequences ----------------------------------------------------------------------------------
    def new_state(self) -> DeepseekV4State:
        return DeepseekV4State(self)

    def reserve(self, state: DeepseekV4State, num_tokens: int) -> None:
        """Give ``state`` a slot and the pages its entries need once it holds ``num_tokens`` tokens."""
        if state.slot is None:
            state.slot = self._take_slot()
        for r in self.ratios:
            have = state.pages.setdefault(r, [])
            while len(have) < self.spec.pages_for(num_tokens, r):
                have.append(self._take_page(r))

    def release(self, state: DeepseekV4State) -> None:
        if state.slot is not None:
            self._free_slots.append(state.slot)
        for r, ids in state.pages.items():
            self._free_pages[r].extend(reversed(ids))
        state.slot, state.pages, state.num_tokens = None, {}, 0

    def fork(self, state: DeepseekV4State) -> DeepseekV4State:
        """A copy of ``state`` in its own slot and pages."""
        child = DeepseekV4State(self, num_tokens=state.num_tokens)
        if state.slot is None:
            return child
        self.reserve(child, state.num_tokens)
        for layer in self.layers:
            layer.kv[self.ring_rows(child.held_slot)] = layer.kv[self.ring_rows(state.slot)]
            for cache in (layer.compressor, layer.indexer):
                for t in cache.tensors() if cache is not None else ():
                    t[child.held_slot] = t[state.slot]
            if layer.ratio:
                src, dst = self.page_rows(state, layer.ratio), self.page_rows(child, layer.ratio)
                layer.kv[self.entry_base + dst] = layer.kv[self.entry_base + src]
                if layer.index_keys is not None:
                    layer.index_keys[dst] = layer.index_keys[src]
        return child

    def nbytes_of(self, state: DeepseekV4State) -> int:
        if state.slot is None:
            return 0
        return self.slot_bytes + sum(len(ids) * self.page_bytes[r] for r, ids in state.pages.items())

    # --- addressing ---------------------------------------------------------------------------------
    @property
    def entry_base(self) -> int:
        """Row of page 0 in every layer's ``kv`` (the rings come first)."""
        return self.slots * self.spec.window

    def ring_rows(self, slot: int) -> torch.Tensor:
        w = self.spec.window
        return torch.arange(slot * w, (slot + 1) * w, device=self.device)

    def page_rows(self, state: DeepseekV4State, ratio: int) -> torch.Tensor:
        """Rows (relative to page 0) of every page ``state`` holds for ``ratio``, in entry order."""
        table = torch.tensor([state.pages.get(ratio, [])], dtype=torch.int64)
        return entry_rows(table, self.spec.page_size)[0].to(self.device)

    def page_table(self, states: list[DeepseekV4State], ratio: int, width: int) -> torch.Tensor:
        """Host int64 ``[len(states), width]`` page ids per sequence, padded with the null page 0."""
        return torch.tensor(padded_pages(states, ratio, width), dtype=torch.int64).view(len(states), width)

    def layer_view(self, state: DeepseekV4State, index: int) -> LayerView:
        layer = self.layers[index]
        if state.slot is None:
            raise ValueError("this state holds no tokens yet")
        ring = layer.kv[self.ring_rows(state.slot)].clone()
        entries = pending = keys = None
        if layer.compressor is not None:  # a compressed layer
            count = state.num_tokens // layer.ratio
            rows = self.page_rows(state, layer.ratio)[:count]
            entries = layer.kv[self.entry_base + rows].clone()
            width = layer.compressor.pending.shape[-1] // 2
            pending = layer.compressor.pending[state.slot, : state.num_tokens % layer.ratio, :width].clone()
            if layer.index_keys is not None:
                keys = layer.index_keys[rows].clone()
        return LayerView(ring, entries, pending, keys)

    # --- allocation ---------------------------------------------------------------------------------
    def _take_slot(self) -> int:
        if not self._free_slots:
            if not self.growable:
                raise RuntimeError(f"state pool has no free slot (all {self.slots - 1} in use)")
            self._grow(slots=2 * self.slots)
        return self._free_slots.pop()

    def _take_page(self, ratio: int) -> int:
        if not self._free_pages[ratio]:
            if not self.growable:
                raise RuntimeError(f"state pool has no free page for compression ratio {ratio} "
                                   f"(all {self.pages[ratio] - 1} in use)")
            self._grow(pages={**self.pages, ratio: 2 * self.pages[ratio]})
        return self._free_pages[ratio].pop()

    def _grow(self, slots: int | None = None, pages: dict[int, int] | None = None) -> None:
        """Reallocate every layer with more slots or pages, keeping the contents (growable pools only)."""
        old_slots, old_pages, old_base = self.slots, dict(self.pages), self.entry_base
        self.slots = slots or self.slots
        self.pages = pages or self.pages
        window, page = self.spec.window, self.spec.page_size
        for i, old in enumerate(self.layers):
            new = LayerCache(self.spec, i, self.slots, self.pages, self.dtype, self.device)
            new.kv[: old_slots * window] = old.kv[: old_slots * window]
            if old.compressor is not None and new.compressor is not None:  # a compressed layer
                n = old_pages[old.ratio] * page
                new.kv[self.entry_base : self.entry_base + n] = old.kv[old_base : old_base + n]
                for a, b in zip(old.compressor.tensors(), new.compressor.tensors(), strict=True):
                    b[:old_slots] = a
            if old.indexer is not None and new.indexer is not None:  # CSA: its indexer's too
                assert old.index_keys is not None and new.index_keys is not None  # held with the indexer
                new.index_keys[: old.index_keys.shape[0]] = old.index_keys
                for a, b in zip(old.indexer.tensors(), new.indexer.tensors(), strict=True):
                    b[:old_slots] = a
            self.layers[i] = new
        self._free_slots = list(range(self.slots - 1, old_slots - 1, -1)) + self._free_slots
        for r, n in self.pages.items():
            self._free_pages[r] = list(range(n - 1, old_pages[r] - 1, -1)) + self._free_pages[r]


def _layer_tensors(layer: LayerCache) -> list[torch.Tensor]:
    out = [layer.kv]
    for cache in (layer.compressor, layer.indexer):
        if cache is not None:
            out += cache.tensors()
    if layer.index_keys is not None:
        out.append(layer.index_keys)
    return out

"""What one sequence's state is made of, declared as buffers: the shapes a state pool allocates and sizes.

A model describes its state as a list of buffers of three kinds, and the pool (:mod:`.pool`) allocates, forks,
grows and sizes them without knowing what they hold:

- :class:`KVBuffer`: one attention pool tensor.  ``rings`` SWA rings (``window`` rows per slot each: one per
  layer that attends through this tensor), then, when ``ratio`` is set, the pages of compressed entries of that
  ratio.  Sparse attention reads a layer's window and its entries through one tensor this way.
- :class:`SlotBuffer`: carry-over with a fixed shape per slot (a compressor's unfinished window, an n-gram history).
- :class:`PageBuffer`: one row per compressed entry, in the pages of a ratio (indexer keys).

A sequence holds one slot (every slot buffer's row and every ring's ``window`` rows) and, per compression ratio,
pages of ``page_size`` entries each (a row of every page buffer and of every KV buffer's pages of that ratio).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Compressed entries per page.
PAGE_SIZE = 16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class KVBuffer:
    """``[rings * slots * window + pages * page_size, width]``: rings first (ring ``m`` of slot ``s`` at rows
    ``(m * slots + s) * window ...``), then the entry pages of ``ratio`` (0: rings only)."""

    name: str
    rings: int
    ratio: int
    width: int
    dtype: torch.dtype | None = None  # None: the model's dtype


@dataclass(slots=True, frozen=True)
class SlotBuffer:
    """``[slots, *shape]``: a fixed amount of carry-over per sequence."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


@dataclass(slots=True, frozen=True)
class PageBuffer:
    """``[pages * page_size, width]``: one row per compressed entry of ``ratio``."""

    name: str
    ratio: int
    width: int
    dtype: torch.dtype | None = None


Buffer = KVBuffer | SlotBuffer | PageBuffer


def _elements(buffer: Buffer, window: int) -> tuple[int, int]:
    """(elements per slot, elements per entry) of ``buffer``."""
    if isinstance(buffer, KVBuffer):
        return buffer.rings * window * buffer.width, buffer.width if buffer.ratio else 0
    if isinstance(buffer, SlotBuffer):
        n = 1
        for d in buffer.shape:
            n *= d
        return n, 0
    return 0, buffer.width


def _ratio(buffer: Buffer) -> int:
    return 0 if isinstance(buffer, SlotBuffer) else buffer.ratio


@dataclass(slots=True, frozen=True)
class StateSpec:
    """Every buffer of one sequence's state (plain data from the model config)."""

    window: int
    buffers: tuple[Buffer, ...]
    page_size: int = PAGE_SIZE
    #: Per element size: (slot bytes, {ratio: page bytes}); filled on first use (the scheduler asks every step).
    _sizes: dict[int, tuple[int, dict[int, int]]] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"state buffers must have distinct names, got {names}")

    @property
    def paged_ratios(self) -> tuple[int, ...]:
        """Compression ratios that have pages, ascending."""
        return tuple(sorted({_ratio(b) for b in self.buffers if _ratio(b)}))

    def of(self, kind: type) -> list[Buffer]:
        return [b for b in self.buffers if isinstance(b, kind)]

    def pages_for(self, num_tokens: int, ratio: int) -> int:
        """Pages holding the entries of ``num_tokens`` tokens (one per closed window of ``ratio``)."""
        return ceil_div(num_tokens // ratio, self.page_size)

    def byte_sizes(self, element_size: int) -> tuple[int, dict[int, int]]:
        """(bytes of one slot, {ratio: bytes of one page}) when the model's dtype has ``element_size`` bytes
        (buffers with their own dtype count theirs)."""
        sizes = self._sizes.get(element_size)
        if sizes is None:
            slot, pages = 0, {r: 0 for r in self.paged_ratios}
            for b in self.buffers:
                size = element_size if b.dtype is None else torch.empty(0, dtype=b.dtype).element_size()
                per_slot, per_entry = _elements(b, self.window)
                slot += per_slot * size
                if per_entry:
                    pages[_ratio(b)] += self.page_size * per_entry * size
            sizes = self._sizes[element_size] = (slot, pages)
        return sizes

    def state_bytes(self, num_tokens: int, element_size: int) -> int:
        """Bytes a sequence of ``num_tokens`` tokens holds: its slot and its pages (0 before its first token)."""
        if num_tokens <= 0:
            return 0
        slot, pages = self.byte_sizes(element_size)
        return slot + sum(self.pages_for(num_tokens, r) * size for r, size in pages.items())

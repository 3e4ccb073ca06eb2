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

A KV or page buffer may store its rows in a :class:`RowFormat` (packed bytes, :mod:`deepinfer.ops.kv_quant`)
instead of the model's dtype; a KV buffer whose rings and entries have different formats is two tensors (rings,
and entries under :func:`entries_name`), addressed as one: row ``entry_base`` is the first entry either way.
Sizes count the stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

#: Compressed entries per page.
PAGE_SIZE = 16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class RowFormat:
    """Rows stored quantized: ``kind`` codes (``fp8_e4m3``: a byte each, ``fp4_e2m1``: two a byte), then one
    scale byte per ``block`` values (``scale_format``: ``ue8m0`` or ``e4m3``)."""

    kind: str
    block: int
    scale_format: str = "ue8m0"

    def __post_init__(self) -> None:
        if self.kind not in ("fp8_e4m3", "fp4_e2m1") or self.scale_format not in ("ue8m0", "e4m3"):
            raise ValueError(f"RowFormat: kind must be 'fp8_e4m3' or 'fp4_e2m1' and scale_format 'ue8m0' or "
                             f"'e4m3', got {self.kind!r}, {self.scale_format!r}")

    def fits(self, width: int) -> bool:
        """Whether rows of ``width`` values can be stored in this format (whole blocks, whole bytes)."""
        return width % self.block == 0 and width % 2 == 0

    def row_bytes(self, width: int) -> int:
        codes = width if self.kind == "fp8_e4m3" else width // 2
        return codes + width // self.block


def entries_name(name: str) -> str:
    """The tensor holding the entries of KV buffer ``name`` when they are stored apart from its rings."""
    return name + ".entries"


@dataclass(slots=True, frozen=True)
class KVBuffer:
    """``[rings * slots * ring + pages * page_size, width]``: rings first (ring ``m`` of slot ``s`` at rows
    ``(m * slots + s) * ring ...``, ``ring = StateSpec.ring``), then the entry pages of ``ratio`` (0: rings only)."""

    name: str
    rings: int
    ratio: int
    width: int
    dtype: torch.dtype | None = None  # None: the model's dtype
    ring_format: RowFormat | None = None  # rows stored packed (None: in ``dtype``)
    entry_format: RowFormat | None = None

    @property
    def split(self) -> bool:
        """Rings and entries stored in two tensors (their formats differ)."""
        return bool(self.ratio) and self.ring_format != self.entry_format


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
    format: RowFormat | None = None  # rows stored packed (None: in ``dtype``)


Buffer = KVBuffer | SlotBuffer | PageBuffer


def row_bytes(fmt: RowFormat | None, width: int, element_size: int) -> int:
    """Bytes of one stored row of ``width`` values."""
    return fmt.row_bytes(width) if fmt is not None else width * element_size


def _bytes(buffer: Buffer, ring_rows: int, element_size: int) -> tuple[int, int]:
    """(bytes per slot, bytes per entry) of ``buffer``, its elements ``element_size`` bytes where not packed."""
    if isinstance(buffer, KVBuffer):
        ring = buffer.rings * ring_rows * row_bytes(buffer.ring_format, buffer.width, element_size)
        return ring, row_bytes(buffer.entry_format, buffer.width, element_size) if buffer.ratio else 0
    if isinstance(buffer, SlotBuffer):
        n = element_size
        for d in buffer.shape:
            n *= d
        return n, 0
    return 0, row_bytes(buffer.format, buffer.width, element_size)


def _ratio(buffer: Buffer) -> int:
    return 0 if isinstance(buffer, SlotBuffer) else buffer.ratio


@dataclass(slots=True, frozen=True)
class StateSpec:
    """Every buffer of one sequence's state (plain data from the model config)."""

    window: int
    buffers: tuple[Buffer, ...]
    page_size: int = PAGE_SIZE
    #: Ring rows beyond the window: a step of up to ``ring_spare + 1`` tokens per sequence (a speculative verify
    #: step: anchor and drafts) writes its rows without overwriting any row a query of the step still reads.
    ring_spare: int = 0
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

    @property
    def ring(self) -> int:
        """Rows of one ring of a slot: position ``p`` is row ``p % ring``."""
        return self.window + self.ring_spare

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
                per_slot, per_entry = _bytes(b, self.ring, size)
                slot += per_slot
                if per_entry:
                    pages[_ratio(b)] += self.page_size * per_entry
            sizes = self._sizes[element_size] = (slot, pages)
        return sizes

    def unpacked(self) -> StateSpec:
        """The same buffers with every row in the model's dtype (what packing is measured against)."""
        plain = [replace(b, ring_format=None, entry_format=None) if isinstance(b, KVBuffer)
                 else replace(b, format=None) if isinstance(b, PageBuffer) else b for b in self.buffers]
        return StateSpec(self.window, tuple(plain), self.page_size, self.ring_spare)

    def state_bytes(self, num_tokens: int, element_size: int) -> int:
        """Bytes a sequence of ``num_tokens`` tokens holds: its slot and its pages (0 before its first token)."""
        if num_tokens <= 0:
            return 0
        slot, pages = self.byte_sizes(element_size)
        return slot + sum(self.pages_for(num_tokens, r) * size for r, size in pages.items())

"""A state buffer's rows as values, whatever their stored form.

A model whose rows carry a quantization of their own (V4.1 fake-quantizes its K=V latents and indexer keys) gives
each buffer a :class:`RowStore` with that :class:`~.spec.RowFormat`.  ``encode(x)`` returns (what to store, the
values the model computes with): the fake-quantized rows twice when the buffer holds the model's dtype, or the
packed rows and their unpacked values when it stores the format itself (``packed``).  Both give the same values
bit for bit (``unpack(pack(x)) == fake_quant(x)``, :mod:`deepinfer.ops.kv_quant`), so the storage changes no
logit.  Reads unpack where the rows are read, except where an op reads the packed bytes itself: a decode step's
attention (:meth:`KVStore.packed_rows`, ``sparse_attention_packed_inverse_rope``) and the indexer's scoring
(:meth:`RowStore.in_place`, ``indexer_*_packed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.spec import RowFormat
from deepinfer.ops import Ops


def fake_quant(ops: Ops, fmt: RowFormat, x: torch.Tensor) -> torch.Tensor:
    """Rows rounded onto ``fmt``'s grid and back (x itself when its width is not a multiple of the block)."""
    if fmt.kind == "fp8_e4m3":
        return ops.fp8_e4m3_fake_quant(x, fmt.block)
    return ops.fp4_e2m1_fake_quant(x, fmt.block, "e4m3" if fmt.scale_format == "e4m3" else "ue8m0")


def pack(ops: Ops, fmt: RowFormat, x: torch.Tensor) -> torch.Tensor:
    if fmt.kind == "fp8_e4m3":
        return ops.fp8_e4m3_pack(x, fmt.block)
    return ops.fp4_e2m1_pack(x, fmt.block, "e4m3" if fmt.scale_format == "e4m3" else "ue8m0")


def unpack(ops: Ops, fmt: RowFormat, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if fmt.kind == "fp8_e4m3":
        return ops.fp8_e4m3_unpack(rows, fmt.block, dtype)
    return ops.fp4_e2m1_unpack(rows, fmt.block, "e4m3" if fmt.scale_format == "e4m3" else "ue8m0", dtype)


class RowStore:
    """Rows of one tensor (``[rows, width]`` in ``dtype``, or ``[rows, fmt.row_bytes(width)]`` uint8 if
    ``packed``); ``fmt``: the rows' quantization (None: none)."""

    __slots__ = ("dtype", "fmt", "ops", "packed", "tensor")

    def __init__(self, ops: Ops, tensor: torch.Tensor, fmt: RowFormat | None, packed: bool, dtype: torch.dtype):
        if packed and fmt is None:
            raise ValueError("a packed RowStore needs its RowFormat")
        self.ops, self.tensor, self.fmt, self.packed, self.dtype = ops, tensor, fmt, packed, dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows to store, their values) of new rows ``x`` [..., width]."""
        if self.fmt is None:
            return x, x
        if self.packed:
            stored = pack(self.ops, self.fmt, x)
            return stored, unpack(self.ops, self.fmt, stored, x.dtype)
        values = fake_quant(self.ops, self.fmt, x)
        return values, values

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What to store for new rows ``x`` (``encode(x)[0]`` without unpacking)."""
        if self.fmt is None:
            return x
        return pack(self.ops, self.fmt, x) if self.packed else fake_quant(self.ops, self.fmt, x)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Values of stored ``rows`` (any shape of int64 row ids) -> [*rows.shape, width]."""
        got = self.tensor[rows]
        return unpack(self.ops, self.fmt, got, self.dtype) if self.packed and self.fmt is not None else got

    def in_place(self, rows: torch.Tensor) -> PagedRows | None:
        """Stored ``rows`` for an op that reads the packed bytes itself; None where the rows are values."""
        if not self.packed or self.fmt is None:
            return None
        return PagedRows(self.tensor, rows, self.fmt)

    def write(self, rows: torch.Tensor, stored: torch.Tensor) -> None:
        self.tensor.index_copy_(0, rows, stored)


@dataclass(slots=True, frozen=True)
class PackedRows:
    """A KV buffer's packed rows as attention reads them in place: ``rings`` (FP8) and ``entries`` (FP4, maybe no
    rows), one numbering (``r >= entry_base``: entry ``r - entry_base``)."""

    rings: torch.Tensor
    entries: torch.Tensor
    entry_base: int
    ring_format: RowFormat
    entry_format: RowFormat


@dataclass(slots=True, frozen=True)
class PagedRows:
    """Rows ``rows`` (any shape of row ids) of a packed store's ``tensor``, for an op to read in place."""

    tensor: torch.Tensor
    rows: torch.Tensor
    fmt: RowFormat


class KVStore:
    """A KV buffer as attention sees it: rows below ``entry_base`` are rings, the rest compressed entries, in one
    tensor or, when their formats differ, in two (``entries`` then starts at its row 0)."""

    __slots__ = ("entries", "entry_base", "joint", "rings")

    def __init__(self, rings: RowStore, entries: RowStore, entry_base: int, joint: bool):
        self.rings, self.entries, self.entry_base, self.joint = rings, entries, entry_base, joint

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Values of rows (ring or entry ids, the joint numbering) -> [*rows.shape, width]."""
        if self.joint:
            return self.rings.read(rows)
        base = self.entry_base
        ring = self.rings.read(rows.clamp(max=base - 1))
        entry = self.entries.read((rows - base).clamp(min=0))
        return torch.where((rows < base).unsqueeze(-1), ring, entry)

    def write_rings(self, rows: torch.Tensor, stored: torch.Tensor) -> None:
        self.rings.write(rows, stored)

    def write_entries(self, rows: torch.Tensor, stored: torch.Tensor) -> None:
        """``rows`` relative to the first entry."""
        self.entries.write(rows, stored)

    def packed_rows(self) -> PackedRows | None:
        """The packed rows for attention to read in place, when every row attention may name is packed (rings in
        FP8, entries in FP4, or no entries); None: read through :meth:`attention_pool`."""
        rings, entries = self.rings, self.entries
        if not rings.packed or rings.fmt is None or rings.fmt.kind != "fp8_e4m3" or entries.fmt is None:
            return None
        if entries.fmt.kind != "fp4_e2m1" or not entries.packed and entries.tensor.shape[0]:
            return None
        width = rings.tensor.shape[1] * rings.fmt.block // (rings.fmt.block + 1)
        tensor = entries.tensor if entries.packed else torch.empty(0, entries.fmt.row_bytes(width), dtype=torch.uint8,
                                                                   device=rings.tensor.device)
        return PackedRows(rings.tensor, tensor, self.entry_base, rings.fmt, entries.fmt)

    def attention_pool(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a pool of values, the columns into it) for attention over rows ``cols`` [T, C] (``-1``: none): the
        buffer itself where it holds values, else the rows read and renumbered."""
        if self.joint and not self.rings.packed:
            return self.rings.tensor, cols
        pool = self.read(cols.clamp(min=0).flatten())
        ids = torch.arange(cols.numel(), device=cols.device).view_as(cols)
        return pool, torch.where(cols >= 0, ids, -1)

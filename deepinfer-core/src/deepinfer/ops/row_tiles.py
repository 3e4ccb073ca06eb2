"""Fixed-shape evaluation, the tool behind the batch-invariant references.

A GEMM library picks its kernel, blocking and thread split from the problem's shape, so a row's result
can change with how many other rows share the call (on x86 MKL, a 1-row product is a GEMV that rounds
differently from any GEMM).  Evaluating an op on tiles of exactly :data:`TILE_ROWS` rows, the last one
padded by repeating its final row, makes every call the same shape whatever the batch: a row's result
then depends only on its own inputs.  Likewise :func:`fixed_chunks` cuts a padded width into fixed-size
chunks, so padding appended by other rows never changes the shape of a reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Rows per tile.  Large enough that prefill pays little Python overhead, small enough that a decode
#: step of one request wastes little work on padding.
TILE_ROWS = 16

#: Columns per chunk of a padded width (attention keys, indexer entries).
CHUNK_COLS = 64


def _take(out: Any, n: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:n]
    return type(out)(_take(o, n) for o in out)


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    short = rows - t.shape[0]
    return t if short == 0 else torch.cat([t, t[-1:].expand(short, *t.shape[1:])])


def in_row_tiles(fn: Callable[..., Any], args: Sequence[Any], rows: Sequence[int], **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` evaluated on tiles of :data:`TILE_ROWS` rows of the positional arguments
    ``rows`` (dim 0); the others are passed whole.  Every tensor of the output is cut back to the real rows."""
    total = args[rows[0]].shape[0]
    if total == 0:
        return fn(*args, **kwargs)
    parts = []
    for start in range(0, total, TILE_ROWS):
        n = min(TILE_ROWS, total - start)
        tile = [_pad_rows(a[start : start + n], TILE_ROWS) if i in rows else a for i, a in enumerate(args)]
        parts.append(_take(fn(*tile, **kwargs), n))
    return _cat(parts)


def fixed_chunks(width: int) -> list[slice]:
    """Slices of :data:`CHUNK_COLS` columns covering ``width`` (the last one may be short of real columns;
    callers pad the width up to a multiple first)."""
    return [slice(start, start + CHUNK_COLS) for start in range(0, width, CHUNK_COLS)]


def padded_width(width: int) -> int:
    """``width`` rounded up to a whole number of chunks (at least one)."""
    return max(1, -(-width // CHUNK_COLS)) * CHUNK_COLS

"""Dense projections and the embedding lookup."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles


def _linear_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, k, n in [(1, 64, 32), (9, 128, 96), (33, 512, 256)]:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        yield OpSample((x, w), label=f"{rows}x{k}->{n}")


@reference_op(sample_inputs=_linear_samples, rows=(0,))
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` without bias.

    x: [..., K]; weight: [N, K], same dtype as x.  Returns [..., N] in x.dtype.
    """
    return F.linear(x, weight)


@batch_invariant_reference(linear)
def linear_in_tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Fixed-shape GEMMs of 16 rows: the kernel, hence each row's reduction order, never depends on the batch."""
    return in_row_tiles(F.linear, (x, weight), rows=(0,))


def _grouped_linear_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, groups, k, n in [(1, 2, 64, 16), (7, 8, 256, 64)]:
        x = torch.randn(rows, groups, k, generator=gen).to(dtype)
        w = (torch.randn(groups * n, k, generator=gen) * k**-0.5).to(dtype)
        yield OpSample((x, w), label=f"{rows}x{groups}x{k}->{n}")


@reference_op(sample_inputs=_grouped_linear_samples, rows=(0,))
def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal projection: group ``g`` of x is multiplied by row block ``g`` of weight.

    x: [T, G, K]; weight: [G * N, K] (the checkpoint's ``wo_a`` layout).  Returns [T, G, N] in x.dtype.
    """
    groups = x.shape[1]
    w = weight.view(groups, -1, x.shape[-1])  # [G, N, K]
    return torch.einsum("tgk,gnk->tgn", x, w)


@batch_invariant_reference(grouped_linear)
def grouped_linear_in_tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM on fixed tiles of 16 rows (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(grouped_linear, (x, weight), rows=(0,))


def _embedding_samples(dtype: torch.dtype, gen: torch.Generator):
    for vocab, dim, rows in [(97, 64, 5), (1000, 256, 33)]:
        table = torch.randn(vocab, dim, generator=gen).to(dtype)
        ids = torch.randint(0, vocab, (rows,), generator=gen)
        yield OpSample((ids, table), label=f"{vocab}x{dim}[{rows}]")


@reference_op(sample_inputs=_embedding_samples, rows=(0,))
def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` for token ids.  ids: [T] int64; table: [V, D].  Returns [T, D] in table.dtype."""
    return table[ids]

"""The lightning indexer: per query, the top-k compressed entries by a sum of ReLU'd head scores."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import OpSample, Rows, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import fixed_chunks, in_row_tiles, padded_width


def _indexer_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, heads, dim, seqs, entries, topk in [(6, 16, 32, 2, 9, 4), (20, 64, 128, 3, 40, 16)]:
        q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
        weights = torch.randn(rows, heads, generator=gen).to(dtype)
        keys = torch.randn(seqs, entries, dim, generator=gen).to(dtype)
        seq_ids = torch.sort(torch.randint(0, seqs, (rows,), generator=gen)).values
        limits = torch.randint(0, entries + 1, (rows,), generator=gen)
        yield OpSample((q, weights, keys, seq_ids, limits, topk, dim**-0.5, heads**-0.5), label=f"{rows}q {entries}e")
        yield OpSample((q, weights, keys, seq_ids, limits, entries + 3, dim**-0.5, heads**-0.5), label="k > entries")


def _indexer_rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    """Keep ``rows`` of the queries, only their sequences' keys, and only entries some kept query may see
    (the batch pads keys to its longest sequence)."""
    q, weights, keys, seq_ids, limits, *rest = sample.args
    used, local = torch.unique(seq_ids[rows], return_inverse=True)
    entries = max(1, int(limits[rows].max()))
    args = (q[rows], weights[rows], keys[used, :entries], local, limits[rows], *rest)
    return OpSample(args, dict(sample.kwargs), sample.label)


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_ids: torch.Tensor,
    limits: torch.Tensor,
    softmax_scale: float,
    weights_scale: float,
) -> torch.Tensor:
    """fp32 scores [T, N] of every query against its sequence's entries; ``-inf`` at and past its limit."""
    k = keys[seq_ids].float()  # [T, N, c]
    scores = torch.relu(torch.bmm(q.float(), k.transpose(1, 2))) * softmax_scale  # [T, H, N]
    scores = (scores * (weights.float() * weights_scale).unsqueeze(-1)).sum(dim=1)  # [T, N]
    future = torch.arange(keys.shape[1], device=keys.device)[None, :] >= limits[:, None]
    return scores.masked_fill(future, float("-inf"))


def _compare_selected_scores(actual, expected, sample: OpSample, dtype: torch.dtype) -> None:
    """Which of two (near-)tied entries is kept is implementation-defined: compare what was kept by score."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, "indexer_topk: shape/dtype differ"
    q, weights, keys, seq_ids, limits, _topk, softmax_scale, weights_scale = sample.args
    actual = actual.cpu()
    assert torch.equal(actual >= 0, expected >= 0), "indexer_topk: number of valid picks differs"
    scores = index_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale)

    def picked(idx: torch.Tensor) -> torch.Tensor:
        return torch.where(idx >= 0, scores.gather(1, idx.clamp(min=0)), 0.0).sort(dim=1).values

    atol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(picked(actual), picked(expected), atol=atol, rtol=atol)


@reference_op(sample_inputs=_indexer_samples, compare=_compare_selected_scores,
              rows=Rows((0, 1, 3, 4), _indexer_rows))
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_ids: torch.Tensor,
    limits: torch.Tensor,
    topk: int,
    softmax_scale: float,
    weights_scale: float,
) -> torch.Tensor:
    """Top-``topk`` entries per query by ``sum_h (w_h * weights_scale) * ReLU(q_h . k) * softmax_scale``.

    q: [T, H, c]; weights: [T, H]; keys: [B, N, c] (indexer keys of B sequences, padded to N);
    seq_ids: [T] int64 (the sequence of each query); limits: [T] int64 (entries ``>= limit`` are not causal
    for that query: they pool tokens after it).  Scores are computed in fp32.
    Returns [T, topk] int64 entry ids in descending score order, ``-1`` where fewer entries are valid.
    Ties are broken towards the lower entry id (a stable descending sort), so results are deterministic.
    """
    return _top_entries(index_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale), topk)


def _top_entries(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Ids of the ``topk`` best finite scores per row, best first, ties to the lower id; ``-1`` pads."""
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    kept = min(topk, scores.shape[1])
    ids = torch.where(order.values[:, :kept] > float("-inf"), order.indices[:, :kept], -1)
    if kept < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - kept), -1)], dim=1)
    return ids


@batch_invariant_reference(indexer_topk)
def indexer_topk_fixed_order(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_ids: torch.Tensor,
    limits: torch.Tensor,
    topk: int,
    softmax_scale: float,
    weights_scale: float,
) -> torch.Tensor:
    """Scores on fixed tiles of 16 queries against fixed chunks of 64 entries: neither the batch's size nor
    its longest sequence (which sets how far keys are padded) changes a score's bits, so neither changes
    the selection."""
    entries = keys.shape[1]
    keys = F.pad(keys, (0, 0, 0, padded_width(entries) - entries))

    def tile_scores(q, weights, seq_ids, limits):
        parts = [index_scores(q, weights, keys[:, cols], seq_ids, limits - cols.start, softmax_scale, weights_scale)
                 for cols in fixed_chunks(keys.shape[1])]
        return torch.cat(parts, dim=1)[:, :entries]

    return _top_entries(in_row_tiles(tile_scores, (q, weights, seq_ids, limits), rows=(0, 1, 2, 3)), topk)

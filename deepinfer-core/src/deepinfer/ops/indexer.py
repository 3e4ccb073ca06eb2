"""The lightning indexer: per query, the top-k compressed entries by a sum of ReLU'd head scores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


#: Query rows per step of these reference ops: their gathered keys [rows, N, c] and scores [rows, H, N] stay near
#: this size however long the context (a 700k-token prompt's 8192-row chunk would otherwise take ~100 GiB at once).
ROW_CHUNK_BYTES = 256 << 20


def by_row_chunks(select: Callable[..., Any], keys: torch.Tensor, heads: int, *rows: torch.Tensor) -> Any:
    """``select(*rows)`` over chunks of the query rows (a multiple of the 16-row tiles of the fixed-order forms),
    the outputs (a tensor or a tuple of them) joined along the rows: every row's result is computed alone."""
    total = rows[0].shape[0]
    per_row = 4 * keys.shape[1] * max(keys.shape[2], heads)
    step = max(16, ROW_CHUNK_BYTES // max(1, per_row) // 16 * 16)
    if step >= total:
        return select(*rows)
    parts = [select(*(r[i : i + step] for r in rows)) for i in range(0, total, step)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))
    return torch.cat(parts)


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

    def select(q, weights, seq_ids, limits):
        return _top_entries(index_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale), topk)

    return by_row_chunks(select, keys, q.shape[1], q, weights, seq_ids, limits)


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

    def select(q, weights, seq_ids, limits):
        return _top_entries(_fixed_order_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale), topk)

    return by_row_chunks(select, keys, q.shape[1], q, weights, seq_ids, limits)


def _fixed_order_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor,
                        limits: torch.Tensor, softmax_scale: float, weights_scale: float) -> torch.Tensor:
    """:func:`index_scores` on fixed tiles of 16 queries against fixed chunks of 64 entries."""
    entries = keys.shape[1]
    keys = F.pad(keys, (0, 0, 0, padded_width(entries) - entries))

    def tile_scores(q, weights, seq_ids, limits):
        parts = [index_scores(q, weights, keys[:, cols], seq_ids, limits - cols.start, softmax_scale, weights_scale)
                 for cols in fixed_chunks(keys.shape[1])]
        return torch.cat(parts, dim=1)[:, :entries]

    return in_row_tiles(tile_scores, (q, weights, seq_ids, limits), rows=(0, 1, 2, 3))


# --- V4.1's candidate pool: the candidate source keeps whole blocks of entries; later indexers pick inside them ---
def _candidate_samples(dtype: torch.dtype, gen: torch.Generator):
    for sample in _indexer_samples(dtype, gen):
        for block_size, topk_blocks in ((4, 3), (8, 40)):
            yield OpSample(sample.args + (block_size, topk_blocks), label=sample.label + f" blocks {block_size}")


def _candidate_rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    narrowed = _indexer_rows(OpSample(sample.args[:8], {}, sample.label), rows)
    return OpSample(narrowed.args + sample.args[8:], dict(sample.kwargs), sample.label)


def _compare_candidates(actual, expected, sample: OpSample, dtype: torch.dtype) -> None:
    _compare_selected_scores(actual[0], expected[0], OpSample(sample.args[:8]), dtype)
    if dtype == torch.float32:  # bf16 scores may reorder near-tied blocks
        assert torch.equal(actual[1].cpu(), expected[1]), "indexer_candidates: candidate blocks differ"


def candidate_blocks(scores: torch.Tensor, limits: torch.Tensor, block_size: int, topk_blocks: int) -> torch.Tensor:
    """Blocks ``[T, topk_blocks]`` (ascending ids, ``-1`` pads) of ``block_size`` entries with the best maximum
    score per query; the block of the query's newest causal entry is always kept (a partly filled block would
    otherwise lose to full ones), and blocks with no causal entry never are."""
    rows, entries = scores.shape
    blocks = -(-entries // block_size)
    best = F.pad(scores, (0, blocks * block_size - entries), value=float("-inf")).view(rows, blocks, -1).amax(-1)
    newest = ((limits - 1) // block_size).clamp(min=0)[:, None]
    best = best.scatter(1, newest, torch.where(limits[:, None] > 0, float("inf"), best.gather(1, newest)))
    order = torch.sort(best, dim=1, descending=True, stable=True)
    kept = min(topk_blocks, blocks)
    ids = torch.where(order.values[:, :kept] > float("-inf"), order.indices[:, :kept], blocks)
    ids = torch.sort(ids, dim=1).values  # ascending, the dropped (id ``blocks``) last
    ids = torch.where(ids < blocks, ids, -1)
    return F.pad(ids, (0, topk_blocks - kept), value=-1)


def _in_blocks(scores: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """``scores`` with every entry outside the query's ``blocks`` set to ``-inf``."""
    rows, entries = scores.shape
    count = -(-entries // block_size)
    allowed = torch.zeros(rows, count + 1, dtype=torch.bool, device=scores.device)
    allowed.scatter_(1, torch.where(blocks >= 0, blocks, count).clamp(max=count), True)
    allowed = allowed[:, :count].repeat_interleave(block_size, dim=1)[:, :entries]
    return scores.masked_fill(~allowed, float("-inf"))


@reference_op(sample_inputs=_candidate_samples, compare=_compare_candidates,
              rows=Rows((0, 1, 3, 4), _candidate_rows))
def indexer_candidates(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_ids: torch.Tensor,
    limits: torch.Tensor,
    topk: int,
    softmax_scale: float,
    weights_scale: float,
    block_size: int,
    topk_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate source's :func:`indexer_topk` (its own picks are not restricted) and the candidate pool it
    publishes for later indexers: :func:`candidate_blocks` of its scores.  Returns ``(ids [T, topk],
    blocks [T, topk_blocks] int64)``."""

    def select(q, weights, seq_ids, limits):
        scores = index_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale)
        return _top_entries(scores, topk), candidate_blocks(scores, limits, block_size, topk_blocks)

    return by_row_chunks(select, keys, q.shape[1], q, weights, seq_ids, limits)


@batch_invariant_reference(indexer_candidates)
def indexer_candidates_fixed_order(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale,
                                   block_size, topk_blocks):
    """Scores as :func:`indexer_topk_fixed_order` computes them; the selections are row-local."""

    def select(q, weights, seq_ids, limits):
        scores = _fixed_order_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale)
        return _top_entries(scores, topk), candidate_blocks(scores, limits, block_size, topk_blocks)

    return by_row_chunks(select, keys, q.shape[1], q, weights, seq_ids, limits)


def _in_blocks_samples(dtype: torch.dtype, gen: torch.Generator):
    for sample in _candidate_samples(dtype, gen):
        q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale, block_size, topk_blocks = sample.args
        scores = index_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale)
        blocks = candidate_blocks(scores + torch.rand(scores.shape, generator=gen), limits, block_size, topk_blocks)
        yield OpSample(sample.args[:8] + (blocks, block_size), label=sample.label)


def _in_blocks_rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    narrowed = _indexer_rows(OpSample(sample.args[:8], {}, sample.label), rows)
    return OpSample(narrowed.args + (sample.args[8][rows], sample.args[9]), dict(sample.kwargs), sample.label)


def _compare_in_blocks(actual, expected, sample: OpSample, dtype: torch.dtype) -> None:
    """Every pick lies in one of the query's blocks; what was picked compares by score."""
    blocks, block_size = sample.args[8], sample.args[9]
    picks = actual.cpu()
    inside = (picks < 0) | ((picks // block_size)[:, :, None] == blocks[:, None, :]).any(-1)
    assert bool(inside.all()), "indexer_topk_in_blocks: a pick outside the query's candidate blocks"
    _compare_selected_scores(actual, expected, OpSample(sample.args[:8]), dtype)


@reference_op(sample_inputs=_in_blocks_samples, compare=_compare_in_blocks,
              rows=Rows((0, 1, 3, 4, 8), _in_blocks_rows))
def indexer_topk_in_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_ids: torch.Tensor,
    limits: torch.Tensor,
    topk: int,
    softmax_scale: float,
    weights_scale: float,
    blocks: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """:func:`indexer_topk` restricted to each query's candidate ``blocks`` [T, B] (block ids of ``block_size``
    entries, ``-1`` pads; from :func:`indexer_candidates`): V4.1's index sources after the candidate source."""

    def select(q, weights, seq_ids, limits, blocks):
        scores = index_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale)
        return _top_entries(_in_blocks(scores, blocks, block_size), topk)

    return by_row_chunks(select, keys, q.shape[1], q, weights, seq_ids, limits, blocks)


@batch_invariant_reference(indexer_topk_in_blocks)
def indexer_topk_in_blocks_fixed_order(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale,
                                       blocks, block_size):
    """Scores as :func:`indexer_topk_fixed_order` computes them; the restriction and selection are row-local."""

    def select(q, weights, seq_ids, limits, blocks):
        scores = _fixed_order_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale)
        return _top_entries(_in_blocks(scores, blocks, block_size), topk)

    return by_row_chunks(select, keys, q.shape[1], q, weights, seq_ids, limits, blocks)

"""The lightning indexer over V4.1's packed indexer keys: scores read from the stored bytes, not from unpacked copies.

V4.1's state may store the group's indexer keys as packed FP4 rows (e2m1 codes, a scale byte per ``key_block``:
DeepSeek's 68 B for 128 channels; ``DEEPINFER_QUANTIZED_KV``).  Each op here is its :mod:`.indexer` counterpart
with ``keys`` [B, N, c] replaced by the pages ``key_pages`` [P, c / 2 + c / key_block] uint8 and the rows of each
sequence's entries ``key_rows`` [B, N] int64 (a decode step's page-table rows).  The reference unpacks those rows
and runs the counterpart, which is exactly what the model did before these ops existed (read, unpack, score);
``unpack(pack(x))`` is bit for bit the model's fake-quantized ``x`` (:mod:`.kv_quant`), so no pick changes.  A
backend decodes the bytes inside its scoring loop instead.
"""

from __future__ import annotations

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer.ops.indexer import (
    _candidate_samples,
    _compare_candidates,
    _compare_in_blocks,
    _compare_selected_scores,
    _in_blocks_samples,
    _indexer_samples,
    indexer_candidates,
    indexer_candidates_fixed_order,
    indexer_topk,
    indexer_topk_fixed_order,
    indexer_topk_in_blocks,
    indexer_topk_in_blocks_fixed_order,
)
from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp4_e2m1_unpack
from deepinfer.ops.registry import OpSample, Rows, batch_invariant_reference, reference_op

#: Positions of (key_pages, key_rows, key_block, key_scale_format) in the packed ops' arguments; ``keys`` is at 2 in
#: their counterparts'.
_PACKED = slice(2, 6)


def unpacked_keys(key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int, key_scale_format: ScaleFormat,
                  dtype: torch.dtype) -> torch.Tensor:
    """The keys [B, N, c] in ``dtype`` of the rows ``key_rows`` [B, N] of the packed pages."""
    return fp4_e2m1_unpack(key_pages[key_rows], key_block, key_scale_format, dtype)


def _unpacked(args: tuple) -> tuple:
    """A packed op's arguments as its counterpart's (the keys unpacked to the queries' dtype)."""
    pages, rows, block, fmt = args[_PACKED]
    return (*args[:2], unpacked_keys(pages, rows, block, fmt, args[0].dtype), *args[6:])


def _packed(sample: OpSample, gen: torch.Generator, index: int) -> OpSample:
    """A counterpart's sample with its keys packed into shuffled pages (FP4, ue8m0 per 32 or e4m3 per 16)."""
    q, weights, keys, *rest = sample.args
    seqs, entries, dim = keys.shape
    block, fmt = (32, "ue8m0") if index % 2 == 0 and dim % 32 == 0 else (16, "e4m3")
    spread = torch.exp2(torch.randint(-8, 3, (seqs * entries, 1), generator=gen)).to(keys.dtype)
    rows = torch.randperm(seqs * entries + 5, generator=gen)[: seqs * entries]  # pages hold other rows too
    pages = torch.zeros(seqs * entries + 5, dim // 2 + dim // block, dtype=torch.uint8)
    pages[rows] = fp4_e2m1_pack(keys.flatten(0, 1) * spread, block, fmt)
    return OpSample((q, weights, pages, rows.view(seqs, entries), block, fmt, *rest), dict(sample.kwargs),
                    f"{sample.label} packed {fmt}/{block}")


def _samples(counterpart_samples):
    def samples(dtype: torch.dtype, gen: torch.Generator):
        narrowed = False
        for i, sample in enumerate(counterpart_samples(dtype, gen)):
            yield _packed(sample, gen, i)
            q, weights, keys, *rest = sample.args
            if keys.shape[-1] > 48 and not narrowed:  # a head dim of 48: three blocks of 16, no power of two
                narrowed = True
                narrow = OpSample((q[..., :48], weights, keys[..., :48], *rest), dict(sample.kwargs),
                                  sample.label + " dim 48")
                yield _packed(narrow, gen, 1)

    return samples


def _narrow(sample: OpSample, rows: torch.Tensor) -> OpSample:
    """Keep ``rows`` of the queries and their sequences' key rows (entries some kept query may see)."""
    q, weights, pages, key_rows, block, fmt, seq_ids, limits, *rest = sample.args
    used, local = torch.unique(seq_ids[rows], return_inverse=True)
    entries = max(1, int(limits[rows].max()))
    args = (q[rows], weights[rows], pages, key_rows[used, :entries], block, fmt, local, limits[rows], *rest)
    return OpSample(args, dict(sample.kwargs), sample.label)


def _narrow_in_blocks(sample: OpSample, rows: torch.Tensor) -> OpSample:
    """:func:`_narrow`, and the kept queries' candidate blocks."""
    kept = _narrow(sample, rows)
    return OpSample(kept.args[:11] + (sample.args[11][rows], sample.args[12]), kept.kwargs, kept.label)


def _compare(counterpart_compare):
    def compare(actual, expected, sample: OpSample, dtype: torch.dtype) -> None:
        counterpart_compare(actual, expected, OpSample(_unpacked(sample.args), {}, sample.label), dtype)

    return compare


_ROWS = Rows((0, 1, 6, 7), _narrow)


@reference_op(sample_inputs=_samples(_indexer_samples), compare=_compare(_compare_selected_scores), rows=_ROWS)
def indexer_topk_packed(
    q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
    key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
    weights_scale: float,
) -> torch.Tensor:
    """:func:`~.indexer.indexer_topk` over packed FP4 keys (``key_pages`` rows ``key_rows``)."""
    return indexer_topk(*_unpacked((q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids, limits,
                                    topk, softmax_scale, weights_scale)))


@batch_invariant_reference(indexer_topk_packed)
def indexer_topk_packed_fixed_order(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids, limits,
                                    topk, softmax_scale, weights_scale):
    """The unpacked keys (row-local), then the batch-invariant counterpart (likewise the two below)."""
    return indexer_topk_fixed_order(*_unpacked((q, weights, key_pages, key_rows, key_block, key_scale_format,
                                                seq_ids, limits, topk, softmax_scale, weights_scale)))


@reference_op(sample_inputs=_samples(_candidate_samples), compare=_compare(_compare_candidates), rows=_ROWS)
def indexer_candidates_packed(
    q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
    key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
    weights_scale: float, block_size: int, topk_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.indexer.indexer_candidates` over packed FP4 keys."""
    return indexer_candidates(*_unpacked((q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids,
                                          limits, topk, softmax_scale, weights_scale, block_size, topk_blocks)))


@batch_invariant_reference(indexer_candidates_packed)
def indexer_candidates_packed_fixed_order(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids,
                                          limits, topk, softmax_scale, weights_scale, block_size, topk_blocks):
    return indexer_candidates_fixed_order(*_unpacked((q, weights, key_pages, key_rows, key_block, key_scale_format,
                                                      seq_ids, limits, topk, softmax_scale, weights_scale, block_size,
                                                      topk_blocks)))


@reference_op(sample_inputs=_samples(_in_blocks_samples), compare=_compare(_compare_in_blocks),
              rows=Rows((0, 1, 6, 7, 11), _narrow_in_blocks))
def indexer_topk_in_blocks_packed(
    q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
    key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
    weights_scale: float, blocks: torch.Tensor, block_size: int,
) -> torch.Tensor:
    """:func:`~.indexer.indexer_topk_in_blocks` over packed FP4 keys."""
    return indexer_topk_in_blocks(*_unpacked((q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids,
                                              limits, topk, softmax_scale, weights_scale, blocks, block_size)))


@batch_invariant_reference(indexer_topk_in_blocks_packed)
def indexer_topk_in_blocks_packed_fixed_order(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids,
                                              limits, topk, softmax_scale, weights_scale, blocks, block_size):
    return indexer_topk_in_blocks_fixed_order(*_unpacked((q, weights, key_pages, key_rows, key_block,
                                                          key_scale_format, seq_ids, limits, topk, softmax_scale,
                                                          weights_scale, blocks, block_size)))

"""Sparse attention over V4.1's packed state: the keys are read from the stored bytes, not from unpacked copies.

V4.1's state may store its K=V rows in the model's own formats (``DEEPINFER_QUANTIZED_KV``): a group's sliding
windows as packed FP8 rows ("rings") and its compressed entries as packed FP4 rows, in two tensors
(:mod:`deepinfer.kv.store`).  A decode step's indices name rows of both in one numbering: ``r < entry_base`` is ring
row ``r``, ``r >= entry_base`` entry row ``r - entry_base``.  The reference unpacks the rows a step names and runs
:func:`~.attention.sparse_attention_inverse_rope` on them, which is exactly what the model did before this op
existed (read, unpack, attend); ``unpack(pack(x))`` is bit for bit the model's fake-quantized ``x``
(:mod:`.kv_quant`), so the op changes no logit.  A backend decodes the bytes inside its attention loop instead, with
no gathered copy of the attended rows.
"""

from __future__ import annotations

import torch

from deepinfer.ops.attention import (
    _attention_rows,
    _inverse_rope_samples,
    sparse_attention_inverse_rope,
    sparse_attention_inverse_rope_fixed_order,
)
from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp4_e2m1_unpack, fp8_e4m3_pack, fp8_e4m3_unpack
from deepinfer.ops.registry import OpSample, Rows, batch_invariant_reference, reference_op


def unpacked_rows(rings: torch.Tensor, entries: torch.Tensor, entry_base: int, indices: torch.Tensor,
                  ring_block: int, entry_block: int, entry_scale_format: ScaleFormat, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows ``indices`` [T, K] name, unpacked to ``dtype`` [T * K, D], the columns renumbered into them)."""
    rows = indices.clamp(min=0).flatten()
    values = fp8_e4m3_unpack(rings[rows.clamp(max=entry_base - 1)], ring_block, dtype)
    if entries.shape[0]:  # a sliding-only layer has no entries
        entry = fp4_e2m1_unpack(entries[(rows - entry_base).clamp(min=0)], entry_block, entry_scale_format, dtype)
        values = torch.where((rows < entry_base).unsqueeze(-1), values, entry)
    ids = torch.arange(indices.numel(), device=indices.device).view_as(indices)
    return values, torch.where(indices >= 0, ids, -1)


def _samples(dtype: torch.dtype, gen: torch.Generator):
    """Each sparse-attention sample's pool cut into rings (FP8, ue8m0 per 32) and entries (FP4, e4m3 per 16 or
    ue8m0 per 32), and one with rings only (a sliding-only layer)."""
    for i, sample in enumerate(_inverse_rope_samples(dtype, gen)):
        q, kv, indices, sinks, scale, positions, inv_freq, scaling = sample.args
        if kv.shape[-1] % 32:
            continue
        base = kv.shape[0] // 3 if i % 3 else kv.shape[0]  # every third sample: rings only
        entry_block, fmt = (16, "e4m3") if i % 2 else (32, "ue8m0")
        spread = torch.exp2(torch.randint(-10, 1, (kv.shape[0], 1), generator=gen)).to(kv.dtype)
        rings = fp8_e4m3_pack(kv[:base] * spread[:base], 32)
        entries = fp4_e2m1_pack(kv[base:] * spread[base:], entry_block, fmt)
        yield OpSample((q, rings, entries, base, indices, sinks, scale, positions, inv_freq, scaling, 32, entry_block,
                        fmt), label=f"{sample.label} rings {base} entries {kv.shape[0] - base} {fmt}/{entry_block}")


def _rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    q, rings, entries, base, indices, sinks, scale, positions, *rest = sample.args
    kept = _attention_rows(OpSample((q, rings, indices, sinks, scale)), rows)
    q, _, indices, _, _ = kept.args
    return OpSample((q, rings, entries, base, indices, sinks, scale, positions[rows], *rest), dict(sample.kwargs),
                    sample.label)


@reference_op(sample_inputs=_samples, rows=Rows((0, 4, 7), _rows))
def sparse_attention_packed_inverse_rope(
    q: torch.Tensor, rings: torch.Tensor, entries: torch.Tensor, entry_base: int, indices: torch.Tensor,
    sinks: torch.Tensor, scale: float, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
    ring_block: int, entry_block: int, entry_scale_format: ScaleFormat,
) -> torch.Tensor:
    """:func:`~.attention.sparse_attention_inverse_rope` over packed rows.

    rings: [R, D + D / ring_block] uint8, packed FP8 e4m3 rows with a ue8m0 scale per ``ring_block``; entries:
    [E, D / 2 + D / entry_block] uint8, packed FP4 e2m1 rows with an ``entry_scale_format`` scale per
    ``entry_block`` (E may be 0); indices: [T, K] int64 in the joint numbering (``-1``: unused).  The keys' values
    are unpacked to q.dtype.  Returns [T, H, D] in q.dtype."""
    pool, cols = unpacked_rows(rings, entries, entry_base, indices, ring_block, entry_block, entry_scale_format,
                               q.dtype)
    return sparse_attention_inverse_rope(q, pool, cols, sinks, scale, positions, inv_freq, attention_scaling)


@batch_invariant_reference(sparse_attention_packed_inverse_rope)
def sparse_attention_packed_inverse_rope_fixed_order(q, rings, entries, entry_base, indices, sinks, scale, positions,
                                                     inv_freq, attention_scaling, ring_block, entry_block,
                                                     entry_scale_format):
    """The unpacked rows (row-local), then the batch-invariant attention."""
    pool, cols = unpacked_rows(rings, entries, entry_base, indices, ring_block, entry_block, entry_scale_format,
                               q.dtype)
    return sparse_attention_inverse_rope_fixed_order(q, pool, cols, sinks, scale, positions, inv_freq,
                                                     attention_scaling)

"""Projections whose weight is a dense tensor or one kept in its released format (:class:`QuantizedTensor`).

A model that keeps its checkpoint's FP8 weights (``DEEPINFER_QUANTIZED_WEIGHTS=native``, see
:func:`deepinfer.envs.quantized_weights`) hands its layers :data:`Weight` values; these helpers pick the op:
``linear`` for a dense weight, ``fp8_block_linear`` for FP8 with block scales.  Several projections of one input
run as one GEMM where their weights can be stacked (:func:`stack_rows`): dense with dense, FP8 with FP8 of the same
block when every part but the last fills whole row blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from deepinfer.ops import Ops
from deepinfer.quant import FP8_BLOCK, MXFP4, QuantizedTensor

Weight = torch.Tensor | QuantizedTensor
#: ``weight(name)``: a checkpoint weight as the model keeps it (quantized, or dense in the compute dtype).
GetWeight = Callable[[str], Weight]


def dense_getter(tensors: Mapping[str, Weight], ops: Ops, dtype: torch.dtype) -> Callable[[str], torch.Tensor]:
    """``get(name)``: checkpoint tensor ``name`` dense (a quantized one dequantized into ``dtype``)."""

    def get(name: str) -> torch.Tensor:
        t = tensors[name]
        return t.dequantize(ops, dtype) if isinstance(t, QuantizedTensor) else t

    return get


def stored_weight(tensors: Mapping[str, Weight], get: Callable[[str], torch.Tensor]) -> GetWeight:
    """``weight(name)`` for layers that run quantized GEMMs: FP8 block-scaled and MXFP4 2-D tensors as stored,
    any other (dense, or a format no op takes) through ``get`` (which dequantizes)."""

    def weight(name: str) -> Weight:
        t = tensors[name]
        if isinstance(t, QuantizedTensor) and t.format in (FP8_BLOCK, MXFP4) and len(t.shape) == 2:
            return t
        return get(name)

    return weight


def _fp8(w: Weight) -> QuantizedTensor | None:
    if isinstance(w, QuantizedTensor):
        if w.format != FP8_BLOCK:
            raise ValueError(f"a projection weight must be dense or {FP8_BLOCK!r}, got {w.format!r} {w.shape}")
        return w
    return None


def linear(ops: Ops, x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ W.T``: [..., K] -> [..., N] in x.dtype."""
    q = _fp8(w)
    if q is None:
        assert isinstance(w, torch.Tensor)
        return ops.linear(x, w)
    return ops.fp8_block_linear(x, q.data, q.scale, *q.block)


def grouped_linear(ops: Ops, x: torch.Tensor, w: Weight) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, K], W [G * N, K] -> [T, G, N]."""
    q = _fp8(w)
    if q is None:
        assert isinstance(w, torch.Tensor)
        return ops.grouped_linear(x, w)
    return ops.fp8_block_grouped_linear(x, q.data, q.scale, *q.block)


def swiglu_mlp(ops: Ops, x: torch.Tensor, w13: Weight, w2: Weight, swiglu_limit: float | None) -> torch.Tensor:
    """:func:`deepinfer.ops.moe.swiglu_mlp` (``w13`` = gate rows then up rows) for dense or FP8 weights; the
    same arithmetic as the op's reference."""
    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
        return ops.swiglu_mlp(x, w13, w2, swiglu_limit)
    gate, up = linear(ops, x, w13).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return linear(ops, torch.nn.functional.silu(gate) * up, w2)


def _stackable(a: Weight, b: Weight) -> bool:
    """Whether ``b``'s rows can follow ``a``'s in one weight."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]
    qa, qb = _fp8(a), _fp8(b)
    return (qa is not None and qb is not None and qa.block == qb.block and qa.shape[1] == qb.shape[1]
            and qa.scale.dtype == qb.scale.dtype and qa.shape[0] % qa.block[0] == 0)


def _cat(parts: Sequence[Weight]) -> Weight:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])
    qs = [q for q in map(_fp8, parts) if q is not None]
    rows = sum(q.shape[0] for q in qs)
    return QuantizedTensor(FP8_BLOCK, torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]),
                           (rows, qs[0].shape[1]), qs[0].block)


def stack_rows(parts: Sequence[Weight]) -> list[Weight]:
    """``parts`` with each run of stackable neighbours concatenated along rows (one GEMM each)."""
    runs: list[list[Weight]] = []
    for p in parts:
        if runs and _stackable(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return [_cat(run) for run in runs]


def _row_view(w: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of ``w`` as a view: a dense slice, or FP8 data rows with their scale rows (``start`` is
    on a row block: every stacked part but the last fills whole blocks, :func:`_stackable`)."""
    if isinstance(w, torch.Tensor):
        return w[start:stop]
    q = _fp8(w)
    assert q is not None and start % q.block[0] == 0, (start, w.block)
    scales = q.scale[start // q.block[0] : -(-stop // q.block[0])]
    return QuantizedTensor(FP8_BLOCK, q.data[start:stop], scales, (stop - start, q.shape[1]), q.block)


class Projection:
    """Several projections of one input as few GEMMs: ``proj(ops, x)`` is ``[..., sum of N]``, each part's
    columns in order (``split(self.sizes, -1)`` takes them apart)."""

    __slots__ = ("sizes", "weights")

    def __init__(self, parts: Sequence[Weight]):
        self.sizes = [p.shape[0] for p in parts]
        self.weights = stack_rows(parts)

    def part(self, index: int) -> Weight:
        """Projection ``index``'s weight as a view of the stacked rows, never a copy."""
        start = sum(self.sizes[:index])
        offset = 0
        for w in self.weights:
            if start + self.sizes[index] <= offset + w.shape[0]:
                return _row_view(w, start - offset, start - offset + self.sizes[index])
            offset += w.shape[0]
        raise IndexError(f"part {index} of a projection of {len(self.sizes)}")

    def __call__(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        outs = [linear(ops, x, w) for w in self.weights]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

"""GEMMs on weights kept in their released formats: FP8 e4m3 with block scales, MXFP4 or FP8 routed experts.

The references dequantize the weight to ``x.dtype`` (:mod:`deepinfer.ops.quant`) and run the dense op, so on the
reference backend a model whose weights stay quantized computes exactly what its dequantized twin computes.  A
backend's kernel may do less exact arithmetic, as DeepSeek's own inference code does: for many rows it quantizes
the activation to FP8 e4m3 per 128-channel group and multiplies on FP8 tensor cores.  The FP8 ops' tolerance is
that rounding (:func:`within_fp8_activation_rounding`): every output within ``2^-4 * sum_k |x_k| |w_k|`` (half an
e4m3 ulp of each activation) plus the dtype's tolerance, and the error's RMS within 5% of the output's.

Batch rows: ``x`` (and the routing of ``moe_experts_mxfp4`` / ``moe_experts_fp8``); the weights are shared.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.ops.linear import grouped_linear, linear
from deepinfer.ops.moe import moe_experts, moe_experts_fixed_order
from deepinfer.ops.quant import dequant_fp8_block, dequant_mxfp4
from deepinfer.ops.registry import DEFAULT_TOLERANCES, OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles
from deepinfer.quant.quantize import quantize_fp8_block, quantize_mxfp4  # the samples' quantizers

#: Half an ulp of e4m3 (3 mantissa bits), relative: what quantizing an activation to FP8 may change it by.
FP8_ACTIVATION_ROUNDING = 2.0**-4
#: The error's RMS against the output's RMS: e4m3's rounding errors average ~2-3% of a product (measured on the
#: samples), a scale off by 2x gives 100%.
FP8_RMS_TOLERANCE = 0.05


def _quantized(n: int, k: int, block: tuple[int, int], scale_format: str, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * k**-0.5
    q = quantize_fp8_block(w, block, scale_format)
    return q.data, q.scale


def _fp8_linear_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, k, n, block in [(1, 256, 96, (128, 128)), (9, 128, 160, (32, 32)), (33, 384, 256, (128, 128)),
                              (70, 96, 64, (32, 32))]:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for fmt in ("ue8m0", "fp32"):
            data, scale = _quantized(n, k, block, fmt, gen)
            yield OpSample((x, data, scale, *block), label=f"{rows}x{k}->{n} {block} {fmt}")


def within_fp8_activation_rounding(actual: Any, expected: Any, sample: OpSample, dtype: torch.dtype) -> None:
    """The FP8 GEMMs' tolerance (see the module docstring), for ``(x, data, scale, block_n, block_k)`` samples."""
    x, data, scale, bn, bk = sample.args
    where = f"[{sample.label}] ({dtype})"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{where}: shape/dtype differ"
    w = dequant_fp8_block(data, scale, bn, bk, torch.float32).abs()
    if x.dim() == 3:  # grouped: group g of x against row block g of w
        bound = torch.einsum("tgk,gnk->tgn", x.float().abs(), w.view(x.shape[1], -1, x.shape[-1]))
    else:
        bound = F.linear(x.float().abs(), w)
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    e, a = expected.float(), actual.detach().cpu().float()
    err = (a - e).abs()
    limit = FP8_ACTIVATION_ROUNDING * 1.01 * bound + atol + rtol * e.abs()
    assert (err <= limit).all(), f"{where}: error {float((err - limit).max()):.3g} past the FP8 rounding bound"
    rms = float(e.square().mean().sqrt())
    assert float(err.square().mean().sqrt()) <= FP8_RMS_TOLERANCE * rms + atol, f"{where}: error RMS too large"


@reference_op(sample_inputs=_fp8_linear_samples, rows=(0,), compare=within_fp8_activation_rounding)
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
                     ) -> torch.Tensor:
    """``x @ W.T`` for an FP8 weight with block scales: ``W = weight * scale`` per ``block_n x block_k`` block.

    x: [..., K]; weight: [N, K] float8_e4m3fn; scale: [ceil(N/block_n), ceil(K/block_k)] fp32 or e8m0 (see
    :func:`~deepinfer.ops.quant.dequant_fp8_block`).  Returns [..., N] in x.dtype.  quant: released V4 / V4.1
    dense projections (128x128 or 32x32 blocks, ue8m0 scales).
    """
    return linear(x, dequant_fp8_block(weight, scale, block_n, block_k, x.dtype))


@batch_invariant_reference(fp8_block_linear)
def fp8_block_linear_in_tiles(x, weight, scale, block_n, block_k):
    """The dense GEMM on fixed tiles of 16 rows (see :mod:`deepinfer.ops.row_tiles`)."""
    w = dequant_fp8_block(weight, scale, block_n, block_k, x.dtype)
    return in_row_tiles(F.linear, (x, w), rows=(0,))


def _fp8_grouped_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, groups, k, n, block in [(1, 2, 64, 32, (32, 32)), (7, 4, 256, 128, (128, 128)),
                                      (65, 2, 128, 64, (32, 32))]:
        x = torch.randn(rows, groups, k, generator=gen).to(dtype)
        data, scale = _quantized(groups * n, k, block, "ue8m0", gen)
        yield OpSample((x, data, scale, *block), label=f"{rows}x{groups}x{k}->{n} {block}")


@reference_op(sample_inputs=_fp8_grouped_samples, rows=(0,), compare=within_fp8_activation_rounding)
def fp8_block_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                             block_k: int) -> torch.Tensor:
    """:func:`~deepinfer.ops.linear.grouped_linear` with an FP8 block-scaled weight (V4's ``wo_a``).

    x: [T, G, K]; weight: [G * N, K] float8_e4m3fn, N a multiple of ``block_n`` (a block never spans two groups);
    scale as :func:`fp8_block_linear`'s.  Returns [T, G, N] in x.dtype.
    """
    return grouped_linear(x, dequant_fp8_block(weight, scale, block_n, block_k, x.dtype))


@batch_invariant_reference(fp8_block_grouped_linear)
def fp8_block_grouped_linear_in_tiles(x, weight, scale, block_n, block_k):
    """The grouped GEMM on fixed tiles of 16 rows."""
    w = dequant_fp8_block(weight, scale, block_n, block_k, x.dtype)
    return in_row_tiles(grouped_linear, (x, w), rows=(0,))


def _mxfp4_experts_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, hidden, inter, experts, top_k in [(5, 64, 32, 4, 2), (33, 128, 64, 16, 6)]:
        x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
        weights = torch.rand(rows, top_k, generator=gen)
        w13 = quantize_mxfp4(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5 * 4)
        w2 = quantize_mxfp4(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5)
        yield OpSample((x, ids, weights, w13.data, w13.scale, w2.data, w2.scale, 10.0),
                       label=f"{rows}x{hidden} E={experts} k={top_k}")


def _used_experts(ids: torch.Tensor, *stored: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(ids renumbered 0..U-1 in ascending expert order, each stored tensor's rows of the U experts used)."""
    used = torch.unique(ids)
    return torch.searchsorted(used, ids), [t[used] for t in stored]


@reference_op(sample_inputs=_mxfp4_experts_samples, rows=(0, 1, 2),
              tolerances={torch.float32: (3e-4, 1e-4)})
def moe_experts_mxfp4(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """:func:`~deepinfer.ops.moe.moe_experts` with MXFP4 expert weights (e2m1 packed, e8m0 per 32 columns).

    w13: [E, 2I, H/2] uint8 / int8, w13_scale: [E, 2I, H/32]; w2: [E, H, I/2], w2_scale: [E, H, I/32] (see
    :func:`~deepinfer.ops.quant.dequant_mxfp4`).  The used experts are dequantized to x.dtype (exact: an e2m1
    value times a power of two) and run in :func:`moe_experts`' order.  Returns [T, H] in x.dtype.
    """
    local, (a, sa, b, sb) = _used_experts(ids, w13, w13_scale, w2, w2_scale)
    return moe_experts(x, local, weights, dequant_mxfp4(a, sa, x.dtype), dequant_mxfp4(b, sb, x.dtype), swiglu_limit)


@batch_invariant_reference(moe_experts_mxfp4)
def moe_experts_mxfp4_fixed_order(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit):
    """:func:`~deepinfer.ops.moe.moe_experts_fixed_order` on the dequantized used experts."""
    local, (a, sa, b, sb) = _used_experts(ids, w13, w13_scale, w2, w2_scale)
    return moe_experts_fixed_order(x, local, weights, dequant_mxfp4(a, sa, x.dtype), dequant_mxfp4(b, sb, x.dtype),
                                   swiglu_limit)


def _fp8_experts(w: torch.Tensor, block: tuple[int, int], scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' weights [E, N, K] quantized one by one: (codes [E, N, K], scales [E, ceil(N/bn), ceil(K/bk)])."""
    q = [quantize_fp8_block(e, block, scale_format) for e in w]
    return torch.stack([e.data for e in q]), torch.stack([e.scale for e in q])


def _fp8_experts_samples(dtype: torch.dtype, gen: torch.Generator):
    # (rows, hidden, inter, experts, top_k, block, scales): whole blocks (one 128-column block: a wider K turns
    # moe_experts' bf16 rounding-order differences into a miss, the bf16 kernel's too); partial blocks (160 / 96
    # against 128, and 2I = 192 spans a block boundary inside the up rows); fp32 scales; a block of 48 columns
    for rows, hidden, inter, experts, top_k, block, fmt in [(5, 64, 32, 4, 2, (32, 32), "ue8m0"),
                                                            (33, 128, 64, 16, 6, (128, 128), "ue8m0"),
                                                            (9, 160, 96, 8, 3, (128, 128), "fp32"),
                                                            (3, 96, 64, 4, 2, (32, 48), "ue8m0")]:
        x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
        weights = torch.rand(rows, top_k, generator=gen)
        w13 = _fp8_experts(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5 * 4, block, fmt)
        w2 = _fp8_experts(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5, block, fmt)
        yield OpSample((x, ids, weights, *w13, *w2, *block, 10.0),
                       label=f"{rows}x{hidden} I={inter} E={experts} k={top_k} {block} {fmt}")


def _dequant_fp8_experts(data: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, dtype: torch.dtype
                         ) -> torch.Tensor:
    """Stacked FP8 experts [U, N, K] (scales [U, ceil(N/bn), ceil(K/bk)]) dequantized expert by expert."""
    return torch.stack([dequant_fp8_block(d, s, block_n, block_k, dtype) for d, s in zip(data, scale, strict=True)])


@reference_op(sample_inputs=_fp8_experts_samples, rows=(0, 1, 2),
              tolerances={torch.float32: (3e-4, 1e-4)})
def moe_experts_fp8(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """:func:`~deepinfer.ops.moe.moe_experts` with FP8 e4m3 expert weights, one scale per ``block_n x block_k``
    block of each expert's matrix (DeepSeek V3 / V4's FP8 experts: 128 x 128, ue8m0 or fp32 scales).

    w13: [E, 2I, H] float8_e4m3fn (gate rows then up rows), w13_scale: [E, ceil(2I/bn), ceil(H/bk)]; w2: [E, H, I],
    w2_scale: [E, ceil(H/bn), ceil(I/bk)]; scales as :func:`~deepinfer.ops.quant.dequant_fp8_block`'s.  The used
    experts are dequantized to x.dtype (``code * scale`` formed in fp32, rounded once) and run in
    :func:`moe_experts`' order: no activation is quantized, so the tolerance is ``moe_experts``'.  Returns [T, H]
    in x.dtype.
    """
    local, (a, sa, b, sb) = _used_experts(ids, w13, w13_scale, w2, w2_scale)
    return moe_experts(x, local, weights, _dequant_fp8_experts(a, sa, block_n, block_k, x.dtype),
                       _dequant_fp8_experts(b, sb, block_n, block_k, x.dtype), swiglu_limit)


@batch_invariant_reference(moe_experts_fp8)
def moe_experts_fp8_fixed_order(x, ids, weights, w13, w13_scale, w2, w2_scale, block_n, block_k, swiglu_limit):
    """:func:`~deepinfer.ops.moe.moe_experts_fixed_order` on the dequantized used experts."""
    local, (a, sa, b, sb) = _used_experts(ids, w13, w13_scale, w2, w2_scale)
    return moe_experts_fixed_order(x, local, weights, _dequant_fp8_experts(a, sa, block_n, block_k, x.dtype),
                                   _dequant_fp8_experts(b, sb, block_n, block_k, x.dtype), swiglu_limit)

"""Normalisation ops."""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, reference_op


def _rms_norm_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, dim in [(1, 64), (7, 512), (33, 4096)]:
        x = torch.randn(rows, dim, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
        yield OpSample((x, w, 1e-6), label=f"{rows}x{dim}")
        yield OpSample((x, None, 1e-6), label=f"{rows}x{dim} unweighted")


@reference_op(sample_inputs=_rms_norm_samples, rows=(0,))
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, returned in ``x.dtype``.

    x: [..., D] any float dtype; weight: [D] or None (unweighted norm, as mHC and the per-head q norm use).
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)

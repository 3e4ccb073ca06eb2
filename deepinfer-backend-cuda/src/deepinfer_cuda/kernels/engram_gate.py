"""Engram's gate (V4.1) as one Triton pass per (token, stream): two reductions over D, then the gated update.

Overrides core's ``engram_gate(streams, key, value, q_weight, k_weight, eps)`` (deepinfer/ops/engram.py).  The
program holds its stream's row h and key row k [D] in fp32 registers, sums ``h^2``, ``k^2`` and ``h * (qw * kw)
* k`` over D, forms ``dot = sum * rsqrt(mean(h^2) + eps) * rsqrt(mean(k^2) + eps) / sqrt(D)``, the gate
``sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))`` (the sign bit of a zero dot included) and stores
``h + gate * value`` rounded once (the reference: ~15 elementwise and reduction kernels).  ``key`` and ``value``
are read in place through their strides (the model passes column slices of one projection).  Row-local with a
tile fixed by D: batch-invariant.  Not bit-exact: the reductions' order and ``rsqrt`` differ from the CPU's; within
the op's tolerances (fp32 1e-5, bf16 2e-2).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, engram_gate_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.fake_quant import _f32
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (streams, hidden) compiled ahead of time: V4.1-Flash (4 x 5120).
AOT_SHAPES = ((4, 5120),)
AOT_DTYPES = ("bf16", "fp32")
#: The reference's floor of |dot| under the square root.
GATE_DOT_FLOOR = 1e-6


@triton.jit(do_not_specialize=["eps", "key_row_stride", "key_stream_stride", "value_row_stride"])
def _engram_gate_kernel(streams_ptr, key_ptr, value_ptr, qw_ptr, kw_ptr, out_ptr, eps, key_row_stride,
                        key_stream_stride, value_row_stride, S: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, INV_SQRT_D: tl.constexpr, DOT_FLOOR: tl.constexpr):
    wait_for_producers()
    token = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    row = (token * S + stream) * D
    h = tl.load(streams_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
    k = tl.load(key_ptr + token * key_row_stride + stream * key_stream_stride + cols, mask=ok,
                other=0.0).to(tl.float32)
    w = (tl.load(qw_ptr + stream * D + cols, mask=ok, other=0.0).to(tl.float32)
         * tl.load(kw_ptr + stream * D + cols, mask=ok, other=0.0).to(tl.float32))
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps) * tl.rsqrt(tl.sum(k * k, axis=0) / D + eps)
    dot = tl.sum(h * w * k, axis=0) * rstd * INV_SQRT_D
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), DOT_FLOOR))
    gate = tl.sigmoid(tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root))
    v = tl.load(value_ptr + token * value_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, (h + gate * v).to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _plan(arch: CudaArch, n: int, dim: int) -> tuple[LaunchConfig, dict[str, object]]:
    cfg, block_d = engram_gate_config(arch, dim)
    return cfg, {"S": n, "D": dim, "BLOCK_D": block_d, "INV_SQRT_D": _f32(dim**-0.5),
                 "DOT_FLOOR": _f32(GATE_DOT_FLOOR)}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for n, dim in AOT_SHAPES:
        cfg, const = _plan(arch, n, dim)
        for dtype in AOT_DTYPES:
            sig = {"streams_ptr": f"*{dtype}:D", "key_ptr": f"*{dtype}:D", "value_ptr": f"*{dtype}:D",
                   "qw_ptr": f"*{dtype}:D", "kw_ptr": f"*{dtype}:D", "out_ptr": f"*{dtype}:D", "eps": "fp32",
                   "key_row_stride": "i32", "key_stream_stride": "i32", "value_row_stride": "i32"}
            variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("engram_gate", _engram_gate_kernel, _aot_variants)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride in its last dim (a copy only if it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def prepare(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
            k_weight: torch.Tensor, eps: float, *, arch: CudaArch) -> Launch:
    """Plan ``engram_gate(...)`` for ``arch``: output allocated, nothing launched."""
    tokens, n, dim = streams.shape
    streams = streams.contiguous()
    key, value = _rows(key), _rows(value)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    out = torch.empty_like(streams)
    cfg, const = _plan(arch, n, dim)
    args = dict(streams_ptr=streams, key_ptr=key, value_ptr=value, qw_ptr=q_weight, kw_ptr=k_weight, out_ptr=out,
                eps=float(eps), key_row_stride=key.stride(0), key_stream_stride=key.stride(1),
                value_row_stride=value.stride(0), **const)
    return Launch((tokens, n), cfg, args, out)


# batch-invariant: per token; by construction (not yet checked on an H200)
@override("engram_gate", batch_invariant=True, aot=(KERNEL,))
def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The streams [T, S, D] plus the Engram value [T, D], gated per stream by its key [T, S, D]; streams' dtype."""
    index, arch = cuda_target(streams)
    return prepare(streams, key, value, q_weight, k_weight, eps, arch=arch).run(KERNEL, index)

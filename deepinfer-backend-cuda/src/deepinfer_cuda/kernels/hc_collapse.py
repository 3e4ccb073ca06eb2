"""V4.1's final mHC collapse as one Triton pass: ``sum_k pre[k] * streams[k]`` per token.

Overrides core's ``hc_collapse(streams, pre)`` (deepinfer/ops/mhc.py): fp32 products summed over the N streams
(padded to a power of two with zeros, which add exactly nothing), rounded once to the stream dtype.  One program
per (token, chunk of the hidden dim) reads its N stream chunks once.  Row-local with fixed tiles: batch-invariant.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, hc_collapse_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (streams, hidden) compiled ahead of time: V4.1-Flash (4 x 5120), V4 (4 x 4096).
AOT_SHAPES = ((4, 5120), (4, 4096))
AOT_DTYPES = ("bf16", "fp32")


@triton.jit
def _hc_collapse_kernel(streams_ptr, pre_ptr, out_ptr, N: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    wait_for_producers()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ks = tl.arange(0, BLOCK_N)
    k_ok = ks < N
    col_ok = cols < D
    pre = tl.load(pre_ptr + token * N + ks, mask=k_ok, other=0.0)
    x = tl.load(streams_ptr + token * (N * D) + ks[:, None] * D + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    out = tl.sum(pre[:, None] * x, axis=0)
    tl.store(out_ptr + token * D + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@functools.cache
def _plan(arch: CudaArch, n: int, dim: int) -> tuple[LaunchConfig, dict[str, object]]:
    cfg, block_d = hc_collapse_config(arch, dim)
    return cfg, {"N": n, "D": dim, "BLOCK_N": max(1, 1 << (n - 1).bit_length()), "BLOCK_D": block_d}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for n, dim in AOT_SHAPES:
        cfg, const = _plan(arch, n, dim)
        for dtype in AOT_DTYPES:
            sig = {"streams_ptr": f"*{dtype}:D", "pre_ptr": "*fp32:D", "out_ptr": f"*{dtype}:D"}
            variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("hc_collapse", _hc_collapse_kernel, _aot_variants)


def prepare(streams: torch.Tensor, pre: torch.Tensor, *, arch: CudaArch) -> Launch:
    """Plan ``hc_collapse(streams, pre)`` for ``arch``: output allocated, nothing launched."""
    tokens, n, dim = streams.shape
    streams = streams.contiguous()
    pre = pre.to(device=streams.device, dtype=torch.float32).contiguous()
    out = torch.empty((tokens, dim), dtype=streams.dtype, device=streams.device)
    cfg, const = _plan(arch, n, dim)
    args = dict(streams_ptr=streams, pre_ptr=pre, out_ptr=out, **const)
    return Launch((tokens, triton.cdiv(dim, const["BLOCK_D"])), cfg, args, out)


# batch-invariant: row-local, tiles from the model dims; by construction (not yet checked on an H200)
@override("hc_collapse", batch_invariant=True, aot=(KERNEL,))
def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_k pre[k] * streams[k]`` [T, D] in streams.dtype; streams [T, N, D], pre [T, N] fp32."""
    index, arch = cuda_target(streams)
    return prepare(streams, pre, arch=arch).run(KERNEL, index)

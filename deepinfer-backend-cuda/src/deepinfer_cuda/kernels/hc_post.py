"""mHC post as one Triton pass: ``new[k] = post[k] * out + sum_j comb[j, k] * streams[j]`` per token.

Overrides core's ``hc_post(out, streams, post, comb)`` (deepinfer/ops/mhc.py).  Reads the sublayer output
and the N streams once and writes the N new streams once (the reference makes a broadcast product, a
batched matmul and a sum: three passes).  Like the reference, the fp32 weights are rounded to the stream
dtype first; the sum runs in fp32 and is rounded once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, LaunchConfig, hc_post_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (streams, hidden) compiled ahead of time: V4 (4 x 4096) and V4.1 (4 x 5120).
AOT_SHAPES = ((4, 4096), (4, 5120))
AOT_DTYPES = ("bf16", "fp32")


@triton.jit
def _hc_post_kernel(out_ptr, streams_ptr, post_ptr, comb_ptr, y_ptr,
                    N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    wait_for_producers()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ks = tl.arange(0, N)
    dtype = y_ptr.dtype.element_ty
    # Weights rounded to the stream dtype, as the reference casts them before multiplying.
    post = tl.load(post_ptr + token * N + ks).to(dtype).to(tl.float32)  # [N]
    comb = tl.load(comb_ptr + token * N * N + ks[:, None] * N + ks[None, :]).to(dtype).to(tl.float32)  # [j, k]
    out = tl.load(out_ptr + token * D + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    s = tl.load(streams_ptr + token * N * D + ks[:, None] * D + cols[None, :], mask=col_ok[None, :],
                other=0.0).to(tl.float32)  # [j, BLOCK_D]
    mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)  # [k, BLOCK_D]
    y = post[:, None] * out[None, :] + mixed
    tl.store(y_ptr + token * N * D + ks[:, None] * D + cols[None, :], y.to(dtype), mask=col_ok[None, :])


@functools.cache
def _plan(arch: CudaArch, n: int, dim: int) -> tuple[LaunchConfig, dict[str, object]]:
    cfg, block_d = hc_post_config(arch, dim)
    return cfg, {"N": n, "D": dim, "BLOCK_D": block_d}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for n, dim in AOT_SHAPES:
        cfg, const = _plan(arch, n, dim)
        for dtype in AOT_DTYPES:
            sig = {"out_ptr": f"*{dtype}:D", "streams_ptr": f"*{dtype}:D", "post_ptr": "*fp32:D",
                   "comb_ptr": "*fp32:D", "y_ptr": f"*{dtype}:D"}
            variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("hc_post", _hc_post_kernel, _aot_variants)


def covers(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> bool:
    """The streams are one tile: a power-of-two count."""
    return coverage.is_pow2(streams.shape[1])


def prepare(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            arch: CudaArch) -> Launch:
    """Plan ``hc_post(...)`` for ``arch``: output allocated, arguments built, nothing launched."""
    tokens, n, dim = streams.shape
    if not covers(out, streams, post, comb):
        raise ValueError(f"hc_post: {n} streams; the kernel needs a power of two (the op table runs core's "
                         "reference for other counts)")
    out, streams = out.contiguous(), streams.contiguous()
    post = post.to(torch.float32).contiguous()
    comb = comb.to(torch.float32).contiguous()
    y = torch.empty_like(streams)
    cfg, const = _plan(arch, n, dim)
    args = dict(out_ptr=out, streams_ptr=streams, post_ptr=post, comb_ptr=comb, y_ptr=y, **const)
    return Launch((tokens, triton.cdiv(dim, const["BLOCK_D"])), cfg, args, y)


@override("hc_post", coverage=covers, aot=(KERNEL,))
def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, N, D] after a sublayer; out [T, D], streams [T, N, D], post [T, N] fp32, comb [T, N, N] fp32."""
    index, arch = cuda_target(streams)
    return prepare(out, streams, post, comb, arch=arch).run(KERNEL, index)

"""The second step of a split-K GEMM: ``y = sum_s partial[s]`` in fp32, added in split order, cast to y's dtype.

The GEMM's programs each write the fp32 partial product of their share of K to ``partial`` [S, n] (every element,
so the workspace needs no clearing); this kernel adds the S partials of each element in the order s = 0, 1, ...,
so the result does not depend on which program finished first (atomics would) and a CUDA graph replays it.
Used by ``fp8_block_linear.py``'s decode tiles, which name its AOT variants (their split counts); not an op of its
own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, split_k_sum_config
from deepinfer_cuda.kernel_set.dispatch import Launch
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers


@triton.jit
def to_dtype(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``v`` in ``dtype``, rounded to nearest even (the interpreter's cast truncates)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit(do_not_specialize=["n"])
def split_k_sum_kernel(part_ptr, y_ptr, n, SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr,
                        BLOCK: tl.constexpr):
    """y[i] = partial[0, i] + partial[1, i] + ... for i in [pid * BLOCK, +BLOCK)."""
    wait_for_producers()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * n.to(tl.int64) + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, to_dtype(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=ok)


def constexprs(arch: CudaArch, split_k: int, interpreted: bool) -> dict[str, object]:
    return {"SPLIT_K": split_k, "INTERPRETED": interpreted, "BLOCK": split_k_sum_config(arch).block_rows}


def variants(arch: CudaArch, splits: set[int]) -> list[Variant]:
    """bf16 outputs for each split count in ``splits`` (the GEMM module lists its own)."""
    config = split_k_sum_config(arch)
    sig = {"part_ptr": "*fp32:D", "y_ptr": "*bf16:D", "n": "i32"}
    return [Variant(sig, constexprs(arch, s, False), config.num_warps, config.num_stages)
            for s in sorted(splits) if s > 1]


def plan(partial: torch.Tensor, y: torch.Tensor, *, arch: CudaArch, interpreted: bool) -> Launch:
    """The launch adding ``partial`` [S, *y.shape] (fp32) into ``y``."""
    n = y.numel()
    const = constexprs(arch, partial.shape[0], interpreted)
    return Launch((triton.cdiv(n, const["BLOCK"]),), split_k_sum_config(arch),
                  dict(part_ptr=partial, y_ptr=y, n=n, **const), y)

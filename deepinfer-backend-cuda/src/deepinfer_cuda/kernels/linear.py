"""Decode-sized projections (a few rows) as one weight-streaming Triton GEMM with TMA weight tiles.

Overrides core's ``linear(x, weight)`` (deepinfer/ops/linear.py); ``grouped_linear.py`` runs the same kernel for
``grouped_linear``.  With at most ``LinearTiles.max_rows`` rows a projection is a read of its weight: cuBLAS picks
split-K GEMV tiles for those shapes (~84% of the copy ceiling for V4's 64 MiB projections on the H200, plus a
split-K reduce kernel each), while this kernel streams ``[block_n, block_k]`` weight tiles by TMA, as the MoE
decode GEMMs do (94% there).  Larger calls (prefill) go to cuBLAS, at the matmul rate.

One program per (column tile, group, row tile): ``out[r, g, n] = sum_k x[r, g, k] * w[g * N + n, k]`` over k in
order, fp32 accumulation rounded once to the output dtype (fp32 inputs: IEEE products, not TF32).  A row's result
does not depend on the other rows of its tile, but it is not the cuBLAS result of a larger call, so the op is not
declared batch-invariant: under ``DEEPINFER_BATCH_INVARIANT=1`` core's tiled reference runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer_cuda.arch import CudaArch, LinearTiles, linear_config
from deepinfer_cuda.kernel_set.compile import Variant
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target

#: Work around Triton's CPU interpreter, which computes bf16 ``tl.dot`` wrongly: multiply in fp32 (bf16 products are
#: exact in fp32).  Off on the GPU, turned on by the interpreter test.
INTERPRETED = False


@triton.jit(do_not_specialize=["rows", "groups"])
def _linear_kernel(x_ptr, w_desc, out_ptr, rows, groups, K, N, FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    col0 = tl.program_id(0) * BLOCK_N
    g = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < rows
    x_rows = x_ptr + (r.to(tl.int64) * groups + g) * K  # x [rows, groups, K]
    w_row = g * N + col0  # weight [groups * N, K]: a tile past N reads the next group's rows, never stored
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows[:, None] + ks[None, :], mask=r_ok[:, None] & (ks < K)[None, :], other=0.0)
        w = w_desc.load([w_row, k0]).T  # [BLOCK_K, BLOCK_N]; past K (and the tensor's end) the box reads zeros
        if FP32_DOT or INTERPRETED:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    cols = col0 + tl.arange(0, BLOCK_N)
    out = out_ptr + (r.to(tl.int64)[:, None] * groups + g) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (cols < N)[None, :])


def _constexprs(tiles: LinearTiles, fp32: bool) -> dict[str, object]:
    return {"FP32_DOT": fp32, "INTERPRETED": INTERPRETED, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
            "BLOCK_K": tiles.block_k}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """bf16 activations and weights, K >= 256 and N >= 32, both 16-divisible (every V4 / V4.1 projection)."""
    tiles = linear_config(arch, 4096, 4096)
    sig = {"x_ptr": "*bf16:D", "w_desc": f"tensordesc<bf16[{tiles.block_n}, {tiles.block_k}]>", "out_ptr": "*bf16:D",
           "rows": "i32", "groups": "i32", "K": "i32:D", "N": "i32:D"}
    return [Variant(sig, _constexprs(tiles, False), tiles.config.num_warps, tiles.config.num_stages)]


KERNEL = TritonKernel("linear", _linear_kernel, _aot_variants)


def streams(rows: int, x: torch.Tensor, weight: torch.Tensor, arch: CudaArch) -> bool:
    """Whether the kernel takes a call of ``rows`` rows: few of them, one dtype, a weight TMA can read (16-byte
    aligned rows)."""
    tiles = linear_config(arch, weight.shape[0], x.shape[-1], weight.element_size())
    return (rows <= tiles.max_rows and x.dtype == weight.dtype and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (weight.shape[-1] * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0)


def prepare(x: torch.Tensor, weight: torch.Tensor, groups: int = 1, *, arch: CudaArch) -> Launch:
    """Plan ``out [rows, groups, N] = x [rows, groups, K] @ weight[g * N:(g + 1) * N].T`` for ``arch`` (any row
    count; :func:`linear` sends large calls to cuBLAS): output allocated, arguments built, nothing launched."""
    k = x.shape[-1]
    rows = x.numel() // (groups * k)
    n = weight.shape[0] // groups
    tiles = linear_config(arch, n, k, weight.element_size())
    x = x.contiguous()
    out = torch.empty((rows, groups, n), dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k])
    grid = (triton.cdiv(n, tiles.block_n), groups, triton.cdiv(rows, tiles.block_m))
    return Launch(grid, tiles.config, dict(x_ptr=x, w_desc=desc, out_ptr=out, rows=rows, groups=groups, K=k, N=n,
                                           **_constexprs(tiles, x.dtype == torch.float32)),
                  out.view(*x.shape[:-1], n) if groups == 1 else out)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` [..., N]: the streaming kernel for few rows, else cuBLAS."""
    index, arch = cuda_target(x)
    if not streams(x.numel() // max(1, x.shape[-1]), x, weight, arch):
        return F.linear(x, weight)
    return prepare(x, weight, arch=arch).run(KERNEL, index)

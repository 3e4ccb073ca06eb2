"""FP8 table rows gathered and dequantized in one pass (V4.1's FP8 Engram tables).

Overrides core's ``embedding_fp8(ids, table, scale, block, dtype)`` (deepinfer/ops/quant.py), bit for bit.  Each
program takes ``block_rows`` ids, loads each id's code row [D] (one byte a value) and its scales (an e8m0 byte or
an fp32 value per ``block`` columns), forms ``code * scale`` in fp32 and stores it rounded once to the output
dtype: the reference's arithmetic, without its FP8 intermediate (two gathers, then a dequantization).  Exact:
e4m3 codes are exact in fp32, the product is one IEEE multiply (nothing to fuse), and e8m0 scales are decoded from
their bits as core's ``scale_values`` does (byte 0: 2^-127, byte 255: NaN).  Codes decode by the hardware
conversion; under the CPU interpreter (``INTERPRETED``: no fp8 there) by integer arithmetic, which gives no NaN
for the codes 0x7F / 0xFF (no table holds them).  ids must be valid rows (the reference raises on others; the
kernel reads no bounds).  Row-local: batch-invariant.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, embedding_fp8_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.fp8_block_linear import _code_values
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: The interpreter test turns this on (integer decoding of the codes, rounding to bf16 by hand).
INTERPRETED = False
#: (head_dim, scale block) compiled ahead of time: V4.1-Flash's Engram tables (256 columns, ue8m0 per 32).
AOT_SHAPES = ((256, 32),)
AOT_DTYPES = ("bf16", "fp32")


@triton.jit
def _rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``v`` in ``dtype``, rounded to nearest even.  The interpreter's fp32 -> bf16 cast truncates and
    mangles subnormals (e8m0 byte 0 makes them), so there the bf16 bits are rounded and taken by hand."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        high = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        return high.to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit(do_not_specialize=["n_ids"])
def _embedding_fp8_kernel(ids_ptr, codes_ptr, scale_ptr, out_ptr, n_ids, D: tl.constexpr, BLOCK: tl.constexpr,
                          SCALE_E8M0: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr):
    """Output rows [pid * BLOCK_R, +BLOCK_R): row ``r`` = table row ``ids[r]`` times its scales."""
    wait_for_producers()
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_ids
    cols = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (cols < D)[None, :]
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    codes = tl.load(codes_ptr + ids[:, None] * D + cols[None, :], mask=ok, other=0)
    scale_at = scale_ptr + ids[:, None] * ((D + BLOCK - 1) // BLOCK) + (cols // BLOCK)[None, :]
    if SCALE_E8M0:
        e = tl.load(scale_at, mask=ok, other=127).to(tl.int32)
        # byte 0: 2^-127 (the fp32 subnormal 0x00400000); byte 255: NaN; else 2^(e - 127)
        bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
        scale = bits.to(tl.float32, bitcast=True)
    else:
        scale = tl.load(scale_at, mask=ok, other=0.0).to(tl.float32)
    value = _code_values(codes, INTERPRETED) * scale
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], _rounded(value, out_ptr.dtype.element_ty, INTERPRETED),
             mask=ok)


@functools.cache
def _plan(arch: CudaArch, dim: int, block: int, e8m0: bool) -> tuple[LaunchConfig, dict[str, object]]:
    cfg, block_d = embedding_fp8_config(arch, dim)
    return cfg, {"D": dim, "BLOCK": block, "SCALE_E8M0": e8m0, "BLOCK_D": block_d, "BLOCK_R": cfg.block_rows}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for dim, block in AOT_SHAPES:
        cfg, const = _plan(arch, dim, block, True)
        for dtype in AOT_DTYPES:
            sig = {"ids_ptr": "*i64:D", "codes_ptr": "*u8:D", "scale_ptr": "*u8:D", "out_ptr": f"*{dtype}:D",
                   "n_ids": "i32"}
            variants.append(Variant(sig, {**const, "INTERPRETED": False}, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("embedding_fp8", _embedding_fp8_kernel, _aot_variants)


def prepare(ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype, *,
            arch: CudaArch) -> Launch:
    """Plan ``embedding_fp8(...)`` for ``arch``: output allocated, nothing launched.  The table and its scales are
    read in place (a stored table is contiguous: ``contiguous()`` copies nothing)."""
    dim = table.shape[1]
    codes = table.contiguous().view(torch.uint8)
    e8m0 = scale.element_size() == 1
    scales = scale.contiguous().view(torch.uint8) if e8m0 else scale.contiguous()
    flat = ids.reshape(-1)
    out = torch.empty(flat.shape[0], dim, dtype=dtype, device=table.device)
    cfg, const = _plan(arch, dim, block, e8m0)
    args = dict(ids_ptr=flat, codes_ptr=codes, scale_ptr=scales, out_ptr=out, n_ids=flat.shape[0],
                INTERPRETED=INTERPRETED, **const)
    return Launch((triton.cdiv(flat.shape[0], cfg.block_rows),), cfg, args, out.view(*ids.shape, dim))


# batch-invariant: per looked-up row; by construction (not yet checked on an H200)
@override("embedding_fp8", batch_invariant=True, aot=(KERNEL,))
def embedding_fp8(ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, block: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of the FP8 table [V, D] times their per-``block`` scales: [T, D] in ``dtype``."""
    index, arch = cuda_target(table)
    return prepare(ids, table, scale, block, dtype, arch=arch).run(KERNEL, index)

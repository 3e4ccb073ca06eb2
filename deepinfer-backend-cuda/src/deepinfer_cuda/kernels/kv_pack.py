"""V4.1's packed KV rows in one pass each way: ``_pack_kernel`` quantizes a tile of scale blocks exactly as the
fake-quant kernel does (``fake_quant.py``: the same fp32 operations, bit for bit core's) and stores the codes and
scale bytes of core's layout; ``_unpack_kernel`` decodes them and multiplies (``code * scale`` is exact in bf16:
at most 6 significant bits).  Shared by the four op modules ``fp8_e4m3_pack.py``, ``fp8_e4m3_unpack.py``,
``fp4_e2m1_pack.py``, ``fp4_e2m1_unpack.py`` (core's ``deepinfer/ops/kv_quant.py``).

A packed row of D values is its codes (D bytes for FP8, D / 2 for FP4, low nibble = even channel) then one scale
byte per block (ue8m0 exponent, or an e4m3 code).  One program handles ``BLOCK_R`` scale blocks; a block's
channels are one power-of-two tile (blocks of 16 and 32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, fake_quant_config
from deepinfer_cuda.kernel_set.dispatch import Launch
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.fake_quant import _CONSTANTS, FP4_E4M3, FP4_UE8M0, FP8_UE8M0, _pow2_ceil, _round_to_grid
from deepinfer_cuda.kernels.fp8_block_linear import _e4m3_code, _e4m3_value
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers

#: (D, block, format) compiled ahead of time: V4.1-Flash's SWA K=V, compressed latent, indexer key.
AOT_ROWS = ((512, 32, FP8_UE8M0), (512, 16, FP4_E4M3), (128, 32, FP4_UE8M0))
SCALE_FORMATS = {"e4m3": FP4_E4M3, "ue8m0": FP4_UE8M0}


@triton.jit
def _e2m1_code(q):
    """e2m1 codes (int32) of fp32 values on the grid {0, .5, 1, 1.5, 2, 3, 4, 6} (no -0)."""
    m = tl.abs(q)
    code = tl.where(m <= 2.0, (m * 2.0).to(tl.int32), tl.where(m == 3.0, 5, tl.where(m == 4.0, 6, 7)))
    return tl.where(q < 0, code | 8, code)


@triton.jit
def _e2m1_value(c):
    """fp32 values of e2m1 codes ``s e1 e0 m`` (int32 0..15), built as bits: ``(e + 126, m)`` when e > 0, 0.5 or
    0 when e = 0, signed (``-0`` kept).  Also the packed-KV decode's (``packed_rows.py``)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n_blocks"])
def _pack_kernel(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, PER_ROW: tl.constexpr, FORMAT: tl.constexpr,
                 AMAX_FLOOR: tl.constexpr, UE8M0_MUL: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Scale blocks [pid * BLOCK_R, +BLOCK_R) of x (rows of PER_ROW blocks) -> their codes and scale bytes."""
    wait_for_producers()
    blocks = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = blocks < n_blocks
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + blocks.to(tl.int64)[:, None] * BLOCK + cols[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    row, j = (blocks // PER_ROW).to(tl.int64), blocks % PER_ROW
    if FORMAT == 0:  # FP8 e4m3, ue8m0 scale
        scale = _pow2_ceil(amax * UE8M0_MUL)
        full = tl.broadcast_to(scale[:, None], x.shape)
        q = _round_to_grid(tl.minimum(tl.maximum(tl.div_rn(x, full), -448.0), 448.0), 3, -6, 448.0, INTERPRETED)
        row_bytes = PER_ROW * (BLOCK + 1)
        tl.store(out_ptr + row[:, None] * row_bytes + j[:, None] * BLOCK + cols[None, :],
                 _e4m3_code(q).to(tl.uint8), mask=ok[:, None])
        tl.store(out_ptr + row * row_bytes + PER_ROW * BLOCK + j,
                 ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8), mask=ok)
    else:
        if FORMAT == 1:  # e4m3 scale: a true divide, rounded to e4m3
            scale = _round_to_grid(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), 3, -6, 448.0, INTERPRETED)
            scale_byte = _e4m3_code(scale)
        else:
            scale = _pow2_ceil(amax * UE8M0_MUL)
            scale_byte = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        full = tl.broadcast_to(scale[:, None], x.shape)
        q = _round_to_grid(tl.minimum(tl.maximum(tl.div_rn(x, full), -6.0), 6.0), 1, 0, 6.0, INTERPRETED)
        lo, hi = tl.split(tl.reshape(_e2m1_code(q), [BLOCK_R, BLOCK // 2, 2]))
        row_bytes = PER_ROW * (BLOCK // 2 + 1)
        half = tl.arange(0, BLOCK // 2)
        tl.store(out_ptr + row[:, None] * row_bytes + j[:, None] * (BLOCK // 2) + half[None, :],
                 (lo | (hi << 4)).to(tl.uint8), mask=ok[:, None])
        tl.store(out_ptr + row * row_bytes + PER_ROW * (BLOCK // 2) + j, scale_byte.to(tl.uint8), mask=ok)


@triton.jit(do_not_specialize=["n_blocks"])
def _unpack_kernel(packed_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, PER_ROW: tl.constexpr,
                   FORMAT: tl.constexpr, BLOCK_R: tl.constexpr):
    """Scale blocks [pid * BLOCK_R, +BLOCK_R) of packed rows -> values (``code * scale``, exact in bf16)."""
    wait_for_producers()
    blocks = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = blocks < n_blocks
    cols = tl.arange(0, BLOCK)
    row, j = (blocks // PER_ROW).to(tl.int64), blocks % PER_ROW
    if FORMAT == 0:
        row_bytes = PER_ROW * (BLOCK + 1)
        codes = tl.load(packed_ptr + row[:, None] * row_bytes + j[:, None] * BLOCK + cols[None, :],
                        mask=ok[:, None], other=0).to(tl.int32)
        e = tl.load(packed_ptr + row * row_bytes + PER_ROW * BLOCK + j, mask=ok, other=127).to(tl.int32)
        v = _e4m3_value(codes) * (e << 23).to(tl.float32, bitcast=True)[:, None]
    else:
        row_bytes = PER_ROW * (BLOCK // 2 + 1)
        half = tl.arange(0, BLOCK // 2)
        b = tl.load(packed_ptr + row[:, None] * row_bytes + j[:, None] * (BLOCK // 2) + half[None, :],
                    mask=ok[:, None], other=0).to(tl.int32)
        q = tl.reshape(tl.join(_e2m1_value(b & 15), _e2m1_value(b >> 4)), [BLOCK_R, BLOCK])
        sb = tl.load(packed_ptr + row * row_bytes + PER_ROW * (BLOCK // 2) + j, mask=ok, other=0).to(tl.int32)
        if FORMAT == 1:
            s = _e4m3_value(sb)
        else:
            s = (sb << 23).to(tl.float32, bitcast=True)
        v = q * s[:, None]
    tl.store(out_ptr + blocks.to(tl.int64)[:, None] * BLOCK + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


@functools.cache
def _config(arch: CudaArch, block: int) -> LaunchConfig:
    return fake_quant_config(arch, block)


def _check(width: int, block: int) -> None:
    if block not in (16, 32) or width % block:
        raise ValueError(f"packed KV rows: block must be 16 or 32 and divide the row's {width} values, got {block}")


def plan_pack(x: torch.Tensor, block: int, fmt: int, *, arch: CudaArch, interpreted: bool) -> Launch:
    width = x.shape[-1]
    _check(width, block)
    x = x.contiguous()
    codes = width if fmt == FP8_UE8M0 else width // 2
    out = torch.empty(*x.shape[:-1], codes + width // block, dtype=torch.uint8, device=x.device)
    cfg = _config(arch, block)
    floor, mul = _CONSTANTS[fmt]
    n_blocks = x.numel() // block
    args = dict(x_ptr=x, out_ptr=out, n_blocks=n_blocks, BLOCK=block, PER_ROW=width // block, FORMAT=fmt,
                AMAX_FLOOR=floor, UE8M0_MUL=mul, INTERPRETED=interpreted, BLOCK_R=cfg.block_rows)
    return Launch((triton.cdiv(n_blocks, cfg.block_rows),) if n_blocks else (0,), cfg, args, out)


def plan_unpack(packed: torch.Tensor, block: int, fmt: int, dtype: torch.dtype, *, arch: CudaArch) -> Launch:
    per_code = 1 if fmt == FP8_UE8M0 else 2  # values a code byte holds
    width = packed.shape[-1] * per_code * block // (block + per_code)
    _check(width, block)
    packed = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], width, dtype=dtype, device=packed.device)
    cfg = _config(arch, block)
    n_blocks = out.numel() // block
    args = dict(packed_ptr=packed, out_ptr=out, n_blocks=n_blocks, BLOCK=block, PER_ROW=width // block, FORMAT=fmt,
                BLOCK_R=cfg.block_rows)
    return Launch((triton.cdiv(n_blocks, cfg.block_rows),) if n_blocks else (0,), cfg, args, out)


def pack_variants(arch: CudaArch, fmt_kind: str) -> list[Variant]:
    """bf16 / fp32 rows of V4.1-Flash's widths for the pack kernels of ``fmt_kind`` (``fp8`` / ``fp4``)."""
    variants = []
    for width, block, fmt in AOT_ROWS:
        if (fmt == FP8_UE8M0) != (fmt_kind == "fp8"):
            continue
        cfg = _config(arch, block)
        floor, mul = _CONSTANTS[fmt]
        for dtype in ("bf16", "fp32"):
            sig = {"x_ptr": f"*{dtype}:D", "out_ptr": "*u8:D", "n_blocks": "i32"}
            const = {"BLOCK": block, "PER_ROW": width // block, "FORMAT": fmt, "AMAX_FLOOR": floor, "UE8M0_MUL": mul,
                     "INTERPRETED": False, "BLOCK_R": cfg.block_rows}
            variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


def unpack_variants(arch: CudaArch, fmt_kind: str) -> list[Variant]:
    variants = []
    for width, block, fmt in AOT_ROWS:
        if (fmt == FP8_UE8M0) != (fmt_kind == "fp8"):
            continue
        cfg = _config(arch, block)
        for dtype in ("bf16", "fp32"):
            sig = {"packed_ptr": "*u8:D", "out_ptr": f"*{dtype}:D", "n_blocks": "i32"}
            const = {"BLOCK": block, "PER_ROW": width // block, "FORMAT": fmt, "BLOCK_R": cfg.block_rows}
            variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants

"""V4.1's QAT fake-quantizers as one Triton pass: a tile of scale blocks loaded once, scaled, rounded onto the
FP8 e4m3 / FP4 e2m1 grid and back, stored in the input dtype.  Shared by ``fp8_e4m3_fake_quant.py`` and
``fp4_e2m1_fake_quant.py`` (each op's module has its own ``TritonKernel`` and ``INTERPRETED`` switch); its
arithmetic (:func:`quantize_blocks`, :func:`quantize_rows`) is also the ``QUANT`` epilogue of ``rms_norm_rope``'s
and ``rope``'s kernels, which the fused ops ``rms_norm_rope_fp8_e4m3_fake_quant`` / ``rope_fp4_e2m1_fake_quant``
run.

Bit for bit core's ``deepinfer/ops/fake_quant.py``: the same fp32 operations in the same order, exponents and
powers of two taken from the fp32 bits, IEEE division (``tl.div_rn``: the reference's true divides), round to
nearest even (libdevice ``rint``; under the CPU interpreter the 2^23 trick, exact there), saturation by
``minimum`` (``x`` is clamped first, so no NaN reaches it from a finite input).  The dequantized value has at most
6 significant bits, so its cast to bf16 is exact (the interpreter's truncating cast gives the same bits).
Every block is reduced by itself in a fixed tile: batch-invariant.  NaN inputs are not specified (the model's
activations are finite).
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda.arch import CudaArch, LaunchConfig, fake_quant_config
from deepinfer_cuda.kernel_set.dispatch import Launch
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers

#: FORMAT constexpr: FP8 with a ue8m0 scale, FP4 with an e4m3 scale, FP4 with a ue8m0 scale.
FP8_UE8M0, FP4_E4M3, FP4_UE8M0 = 0, 1, 2
AOT_DTYPES = ("bf16", "fp32")


def _f32(v: float) -> float:
    """``v`` rounded to fp32 (the value torch multiplies by when a Python float meets an fp32 tensor)."""
    return struct.unpack("f", struct.pack("f", v))[0]


#: Each format's (amax floor, multiplier of the ue8m0 scale's amax) as fp32 values, as the reference uses them.
_CONSTANTS = {FP8_UE8M0: (_f32(1e-4), _f32(1.0 / 448.0)), FP4_E4M3: (_f32(6.0 * 2.0**-9), 0.0),
              FP4_UE8M0: (_f32(6.0 * 2.0**-126), _f32(1.0 / 6.0))}


@triton.jit
def _pow2(k):
    """``2^k`` (fp32) for int32 ``k`` in [-126, 128], from the bits (128 gives inf)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(a):
    """Unbiased exponent field of fp32 ``a >= 0`` (-127 for 0)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _pow2_ceil(t):
    """``2^ceil(log2 t)`` for fp32 ``t >= 2^-126``: the exponent field, plus one unless the mantissa is zero."""
    bits = t.to(tl.int32, bitcast=True)
    k = _exponent(t) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return _pow2(tl.minimum(k, 128))


@triton.jit
def _rint(y, INTERPRETED: tl.constexpr):
    """Round to nearest, ties to even, for 0 <= y < 2^22."""
    if INTERPRETED:  # libdevice has no interpreter implementation; adding 2^23 leaves an ulp of 1 (numpy: IEEE)
        return (y + 8388608.0) - 8388608.0
    return libdevice.rint(y)


@triton.jit
def _round_to_grid(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, MAX: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``v`` to the nearest value of a small float format (ties to even), saturating at ``±MAX``; the sign
    (of zero too) kept.  ``a * 2^-k`` and ``r * 2^k`` are exact (|v| <= 448 here: no overflow or underflow)."""
    a = tl.abs(v)
    e = tl.maximum(_exponent(a), MIN_EXP) - MANTISSA
    r = tl.minimum(_rint(a * _pow2(-e), INTERPRETED) * _pow2(e), MAX)
    # the sign bit copied from v: compiled, ``-r`` is ``0 - r``, which turns -0 into +0
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_blocks(x, FORMAT: tl.constexpr, AMAX_FLOOR: tl.constexpr, UE8M0_MUL: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """fp32 ``x`` [R, P], one scale block a row (padded with zeros, which no block maximum sees): quantized and
    dequantized, fp32.  The one copy of the arithmetic: this kernel's, and the epilogue of the kernels that
    rotate (``rms_norm_rope``, ``rope``) when they run a fused op."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)  # [R]
    # tl.div_rn does not broadcast: every operand is given the full [R, P] shape
    if FORMAT == 0:  # FP8 e4m3, ue8m0 scale
        scale = tl.broadcast_to(_pow2_ceil(amax * UE8M0_MUL)[:, None], x.shape)
        q = _round_to_grid(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0), 3, -6, 448.0, INTERPRETED)
    else:
        if FORMAT == 1:  # FP4 e2m1, e4m3 scale: a true divide, rounded to e4m3
            block_scale = _round_to_grid(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), 3, -6, 448.0,
                                         INTERPRETED)
        else:  # FP4 e2m1, ue8m0 scale
            block_scale = _pow2_ceil(amax * UE8M0_MUL)
        scale = tl.broadcast_to(block_scale[:, None], x.shape)
        q = _round_to_grid(tl.minimum(tl.maximum(tl.div_rn(x, scale), -6.0), 6.0), 1, 0, 6.0, INTERPRETED)
        q = tl.where(q == 0.0, 0.0, q)  # -0 -> +0 (the reference's code table has one zero)
    return q * scale


@triton.jit
def quantize_rows(y, ROWS: tl.constexpr, WIDTH: tl.constexpr, QBLOCK: tl.constexpr, FORMAT: tl.constexpr,
                  AMAX_FLOOR: tl.constexpr, UE8M0_MUL: tl.constexpr, INTERPRETED: tl.constexpr):
    """An epilogue: fp32 ``y`` [ROWS, WIDTH] quantized per QBLOCK consecutive channels of a row (QBLOCK a power of
    two dividing WIDTH: the blocks are rows of a reshape that keeps the order)."""
    blocks = tl.reshape(y, (ROWS * (WIDTH // QBLOCK), QBLOCK))
    return tl.reshape(quantize_blocks(blocks, FORMAT, AMAX_FLOOR, UE8M0_MUL, INTERPRETED), (ROWS, WIDTH))


@triton.jit(do_not_specialize=["n_blocks"])
def fake_quant_kernel(x_ptr, y_ptr, n_blocks, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                      FORMAT: tl.constexpr, AMAX_FLOOR: tl.constexpr, UE8M0_MUL: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """Scale blocks [pid * BLOCK_R, +BLOCK_R) of BLOCK contiguous channels (a tile of BLOCK_P, the next power of
    two; padding loads 0, which no block maximum sees): quantized and dequantized."""
    wait_for_producers()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_P)
    mask = (rows < n_blocks)[:, None] & (cols < BLOCK)[None, :]
    offs = rows.to(tl.int64)[:, None] * BLOCK + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = quantize_blocks(x, FORMAT, AMAX_FLOOR, UE8M0_MUL, INTERPRETED)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def quant_constants(block: int, fmt: int, interpreted: bool) -> dict[str, object]:
    """The epilogue's constexprs for ``block`` channels a scale in format ``fmt``."""
    floor, mul = _CONSTANTS[fmt]
    return {"QUANT": True, "QBLOCK": block, "FORMAT": fmt, "AMAX_FLOOR": floor, "UE8M0_MUL": mul,
            "INTERPRETED": interpreted}


#: What a kernel with the epilogue passes when it does not quantize (constexprs: its cubins stay as they were).
NO_QUANT: dict[str, object] = {"QUANT": False, "QBLOCK": 1, "FORMAT": 0, "AMAX_FLOOR": 0.0, "UE8M0_MUL": 0.0,
                               "INTERPRETED": False}


@functools.cache
def _plan(arch: CudaArch, block: int, fmt: int, interpreted: bool) -> tuple[LaunchConfig, dict[str, object]]:
    cfg = fake_quant_config(arch, block)
    floor, mul = _CONSTANTS[fmt]
    return cfg, {"BLOCK": block, "BLOCK_P": 1 << (block - 1).bit_length(), "BLOCK_R": cfg.block_rows,
                 "FORMAT": fmt, "AMAX_FLOOR": floor, "UE8M0_MUL": mul, "INTERPRETED": interpreted}


def aot_variants(arch: CudaArch, formats: tuple[tuple[int, int], ...]) -> list[Variant]:
    """Contiguous bf16 / fp32 rows for each (block, format) in ``formats``."""
    variants = []
    for block, fmt in formats:
        cfg, const = _plan(arch, block, fmt, False)
        for dtype in AOT_DTYPES:
            sig = {"x_ptr": f"*{dtype}:D", "y_ptr": f"*{dtype}:D", "n_blocks": "i32"}
            variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


def plan_fake_quant(x: torch.Tensor, block: int, fmt: int, *, arch: CudaArch, interpreted: bool) -> Launch:
    """The kernel's launch for ``x`` [..., D] (``result``: the quantized copy); when ``D % block``, an empty grid
    whose result is ``x`` itself, as the reference returns it."""
    cfg, const = _plan(arch, block, fmt, interpreted)
    if x.shape[-1] % block:
        return Launch((0,), cfg, {}, x)
    x = x.contiguous()
    y = torch.empty_like(x)
    n_blocks = x.numel() // block
    return Launch((triton.cdiv(n_blocks, cfg.block_rows),), cfg, dict(x_ptr=x, y_ptr=y, n_blocks=n_blocks, **const),
                  y)

"""MXFP8 quantization of an activation tile in registers, for ``tl.dot_scaled``'s e4m3 operand (SM100's
block-scaled MMA, ``tcgen05.mma ... block_scale``): each row's 32-column groups get one e8m0 scale, the power of
two ``2^ceil(log2(amax / 448))`` (so no code saturates), and e4m3 codes of ``x / scale`` rounded to nearest even.

A code then differs from its value by at most half an e4m3 ulp (2^-4 relative; codes below e4m3's normal range
by at most 2^-10 of the scale), the rounding the FP8 GEMMs' tolerance allows.  All-zero groups take the smallest
scale (codes 0).  Compiled, the codes are the hardware conversion (``cvt.rn.satfinite``); under the CPU
interpreter (``INTERPRETED``) they are built as bytes from the rounded values, which ``dot_scaled`` reads as e4m3.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_cuda.kernels.fake_quant import _exponent, _pow2, _round_to_grid
from deepinfer_cuda.kernels.fp8_e4m3_codes import e4m3_code


@triton.jit
def mxfp8_tile(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """(e4m3 codes [BLOCK_M, BLOCK_K] (float8e4nv; uint8 interpreted), e8m0 scale bytes [BLOCK_M, BLOCK_K / 32])
    of the tile ``a`` (any float dtype)."""
    g = tl.reshape(a.to(tl.float32), [BLOCK_M, BLOCK_K // 32, 32])
    amax = tl.max(tl.abs(g), axis=2)
    t = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.1754943508222875e-38)
    bits = t.to(tl.int32, bitcast=True)
    e = tl.minimum(_exponent(t) + ((bits & 0x7FFFFF) != 0).to(tl.int32), 127)  # ceil(log2 t), in [-126, 127]
    q = tl.reshape(g * _pow2(-e)[:, :, None], [BLOCK_M, BLOCK_K])  # exact: a power of two, |q| <= 448
    if INTERPRETED:
        codes = e4m3_code(_round_to_grid(q, 3, -6, 448.0, INTERPRETED)).to(tl.uint8)
    else:
        codes = q.to(tl.float8e4nv)
    return codes, (e + 127).to(tl.uint8)

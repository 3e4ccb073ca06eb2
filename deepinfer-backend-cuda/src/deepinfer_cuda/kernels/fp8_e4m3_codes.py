"""e4m3 codes as integers, for the CPU interpreter (which has no fp8 conversions) and for stored code bytes:
the value of a code and the code of a value already on the e4m3 grid."""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_cuda.kernels.fake_quant import _exponent, _pow2


@triton.jit
def e4m3_value(c):
    """fp32 value of e4m3 codes (int32 0..255; no NaN code in a weight): ``(8 + m) * 2^(e - 10)``, or ``m * 2^-9``
    when e = 0, signed by bit 7."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * _pow2(e - 10))
    # the sign bit set directly: compiled, ``-mag`` is ``0 - mag``, which turns code 0x80 (-0) into +0
    sign = tl.where((c & 128) != 0, -2147483648, 0)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(q):
    """e4m3 codes (int32) of fp32 values on the e4m3 grid (|q| <= 448), -0 kept."""
    a = tl.abs(q)
    ex = _exponent(a)
    normal = ((ex + 7) << 3) | ((a * _pow2(-tl.maximum(ex, -126)) - 1.0) * 8.0).to(tl.int32)
    code = tl.where(ex >= -6, normal, (a * 512.0).to(tl.int32))
    return tl.where(q.to(tl.int32, bitcast=True) < 0, code | 128, code)

"""Activation rows as FP8 e4m3 with one power-of-two scale a row: the inputs of the W4A8 expert GEMMs
(``moe_experts_mxfp4_w4a8_tl.py``), not an op of its own.

``out[r] = e4m3(x[src(r)][cols] / scale[r])`` with ``scale[r] = 2^(e - 134)``, ``e`` the exponent field of the
row's largest magnitude (at least 8): the scaled row's largest value lies in [128, 256), inside e4m3's range (448),
and dividing by a power of two is exact, so the only rounding is e4m3's own (to nearest even).  ``GATHER``: row r
reads x's row ``order[r] // top_k`` (the plan's slot order) at columns ``cols`` (the GEMMs' K order); otherwise
row r of x as it is (the up GEMM already wrote ``act`` in the K order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.moe_experts import AOT_SHAPES

MIN_EXPONENT = 8  #: the exponent field used for rows whose largest magnitude is below 2^-119 (zeros included)
_MIN_EXPONENT = tl.constexpr(MIN_EXPONENT)
#: Triton's interpreter rounds fp32 -> e4m3 wrongly (ties away, carries into the exponent lost); the interpreter
#: test turns this on so the kernel rounds to e4m3's grid in fp32 first (the cast of a grid value is exact).
INTERPRETED = False


@triton.jit
def _on_e4m3_grid(v):
    """fp32 ``v`` (|v| < 448) rounded to nearest even on e4m3's grid: 3 mantissa bits, quantum 2^-9 below 2^-6."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds to an integer, to nearest even
    small = ((tl.abs(v) * 512.0 + magic) - magic) * 0.001953125
    small_bits = small.to(tl.uint32, bitcast=True) | sign
    return tl.where(tl.abs(v) >= 0.015625, normal, small_bits).to(tl.float32, bitcast=True)


@triton.jit
def fp8_e4m3_rows_kernel(x_ptr, order_ptr, cols_ptr, out_ptr, scale_ptr, top_k, N: tl.constexpr,
                         GATHER: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
    """One row a program: its largest magnitude, its scale, its e4m3 codes."""
    wait_for_producers()
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    if GATHER:
        src = (tl.load(order_ptr + r) // top_k).to(tl.int64)
        cols = tl.load(cols_ptr + offs, mask=ok, other=0)
    else:
        src = r.to(tl.int64)
        cols = offs
    x = tl.load(x_ptr + src * N + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, _MIN_EXPONENT)
    inverse = ((261 - e) << 23).to(tl.float32, bitcast=True)  # 2^(134 - e)
    v = x * inverse
    if INTERPRETED:
        v = _on_e4m3_grid(v)
    tl.store(out_ptr + r.to(tl.int64) * N + offs, v.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + r, ((e - 7) << 23).to(tl.float32, bitcast=True))


def _config(n: int) -> tuple[LaunchConfig, int]:
    block = triton.next_power_of_2(n)
    return LaunchConfig(num_warps=min(16, max(4, block // 512))), block


def _variants(arch: CudaArch) -> list[Variant]:
    """The up GEMM's input (bf16 x gathered, ``hidden`` columns) and the down GEMM's (``act``, ``inter``) at the
    routed-expert shapes of V4-Flash and V4.1-Flash."""
    out = []
    for hidden, inter in sorted({(h, i) for h, i, k in AOT_SHAPES if k == 6}):
        for n, gather in ((hidden, True), (inter, False)):
            config, block = _config(n)
            sig = {"x_ptr": "*bf16:D", "order_ptr": "*i32:D", "cols_ptr": "*i32:D", "out_ptr": "*fp8e4nv:D",
                   "scale_ptr": "*fp32:D", "top_k": "i32"}
            out.append(Variant(sig, {"N": n, "GATHER": gather, "INTERPRETED": False, "BLOCK": block}, config.num_warps,
                               config.num_stages))
    return out


KERNEL = TritonKernel("fp8_e4m3_rows", fp8_e4m3_rows_kernel, _variants)


def plan(x: torch.Tensor, rows: int, order: torch.Tensor | None, cols: torch.Tensor | None, top_k: int
         ) -> tuple[Launch, torch.Tensor, torch.Tensor]:
    """(launch, codes [rows, N] e4m3, scales [rows] fp32) of ``x`` [*, N] bf16; ``order`` and ``cols`` both given
    (gather) or both None."""
    n = x.shape[1]
    out = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    gather = order is not None
    config, block = _config(n)
    dummy = scale.view(torch.int32)  # order / cols unused without gather; any int32 pointer
    args = dict(x_ptr=x, order_ptr=order if gather else dummy, cols_ptr=cols if gather else dummy, out_ptr=out,
                scale_ptr=scale, top_k=top_k, N=n, GATHER=gather, INTERPRETED=INTERPRETED, BLOCK=block)
    return Launch((rows,), config, args, (out, scale)), out, scale


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the rows of ``x`` by torch ops: the kernel's oracle."""
    x = x.float()
    e = ((x.abs().amax(1).view(torch.int32) >> 23) & 0xFF).clamp(min=MIN_EXPONENT)
    inverse = ((261 - e) << 23).view(torch.float32)
    return (x * inverse[:, None]).to(torch.float8_e4m3fn), ((e - 7) << 23).view(torch.float32)

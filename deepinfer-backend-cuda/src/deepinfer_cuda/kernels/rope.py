"""Partial interleaved RoPE (and its inverse) as one Triton pass over rows of [T, D] or [T, H, D].

Overrides core's ``rope(x, positions, inv_freq, attention_scaling=1.0, inverse=False)``
(deepinfer/ops/rope.py).  The leading ``D - R`` channels are copied; each interleaved pair of the last ``R``
rotates by ``position * inv_freq[i]``, computed in fp32 with libdevice's sin/cos (full range reduction:
positions reach 10^6, where the fast ``sin.approx`` loses accuracy), once per token and pair.

``QUANT`` (constexpr; off for this op, so its cubins are unchanged in arithmetic): the epilogue of
``rope_fp4_e2m1_fake_quant`` (V4.1's compressed entries, indexer queries and keys): both stores go through
``fake_quant.quantize_rows``, the block quantizer's one copy, applied to the values as rounded to x's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, LaunchConfig, rope_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.fake_quant import NO_QUANT, quant_constants, quantize_rows
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (head_dim, rope_dim, heads) compiled ahead of time: V4 queries (64 heads) and the shared K=V latent (1)
#: at head_dim 512, the lightning indexer's queries (64 heads) and keys (1) at 128; rope_dim 64 throughout.
AOT_SHAPES = ((512, 64, 64), (512, 64, 1), (128, 64, 64), (128, 64, 1))
AOT_DTYPES = ("bf16", "fp32")


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, inv_freq_ptr, y_ptr, x_token_stride, x_head_stride, scaling,
                 D: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_H: tl.constexpr, INVERSE: tl.constexpr, QUANT: tl.constexpr, QBLOCK: tl.constexpr,
                 FORMAT: tl.constexpr, AMAX_FLOOR: tl.constexpr, UE8M0_MUL: tl.constexpr, INTERPRETED: tl.constexpr):
    # One program: one token, BLOCK_H of its heads.  The angle depends on (token, pair) only, so sin/cos
    # are evaluated once per program for the HALF pairs and broadcast over the heads.
    wait_for_producers()
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    src = x_ptr + token * x_token_stride + heads[:, None].to(tl.int64) * x_head_stride
    dst = y_ptr + (token * HEADS + heads[:, None].to(tl.int64)) * D
    # Leading D - 2*HALF channels pass through.
    cols = tl.arange(0, BLOCK_D)
    keep = head_ok[:, None] & (cols < D - 2 * HALF)[None, :]
    if QUANT:  # the fused op: quantized per QBLOCK (the blocks of the rope channels are not stored from here)
        lead = tl.load(src + cols[None, :], mask=keep, other=0.0)
        lead = quantize_rows(lead.to(tl.float32), BLOCK_H, BLOCK_D, QBLOCK, FORMAT, AMAX_FLOOR, UE8M0_MUL,
                             INTERPRETED).to(lead.dtype)
        tl.store(dst + cols[None, :], lead, mask=keep)
    else:
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=keep), mask=keep)
    # Trailing 2*HALF channels: interleaved pairs (x[2i], x[2i+1]) rotate by pos * inv_freq[i].
    pairs = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + pairs)
    cos = libdevice.cos(angle) * scaling
    sin = libdevice.sin(angle) * scaling
    if INVERSE:
        sin = -sin
    rot_cols = D - 2 * HALF + tl.arange(0, 2 * HALF)
    x = tl.load(src + rot_cols[None, :], mask=head_ok[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, HALF, 2)))
    out_even = even * cos[None, :] - odd * sin[None, :]
    out_odd = odd * cos[None, :] + even * sin[None, :]
    y = tl.reshape(tl.interleave(out_even, out_odd), (BLOCK_H, 2 * HALF)).to(x.dtype)
    if QUANT:
        y = quantize_rows(y.to(tl.float32), BLOCK_H, 2 * HALF, QBLOCK, FORMAT, AMAX_FLOOR, UE8M0_MUL,
                          INTERPRETED).to(x.dtype)
    tl.store(dst + rot_cols[None, :], y, mask=head_ok[:, None])


#: The QUANT epilogue's (block, format of kernels/fake_quant.py, interpreted); None: no quantizer.
Quant = tuple[int, int, bool] | None


@functools.cache
def _plan(arch: CudaArch, dim: int, rope_dim: int, heads: int, inverse: bool,
          quant: Quant = None) -> tuple[LaunchConfig, dict[str, object]]:
    cfg = rope_config(arch, dim)
    return cfg, {"D": dim, "HALF": rope_dim // 2, "HEADS": heads, "BLOCK_D": max(16, triton.next_power_of_2(dim)),
                 "BLOCK_H": min(triton.next_power_of_2(heads), cfg.block_rows), "INVERSE": inverse,
                 **(NO_QUANT if quant is None else quant_constants(*quant))}


def aot_variants(arch: CudaArch, shapes: tuple[tuple[int, int, int], ...] = AOT_SHAPES,
                 quants: tuple[Quant, ...] | None = None, inverses: tuple[bool, ...] = (False, True)
                 ) -> list[Variant]:
    """Contiguous rows / heads at each (head_dim, rope_dim, heads) of ``shapes`` (with the epilogue of the same
    place in ``quants``; None: none) x ``inverses``."""
    variants = []
    for (dim, rope_dim, heads), quant in zip(shapes, quants or (None,) * len(shapes), strict=True):
        for dtype in AOT_DTYPES:
            for inverse in inverses:
                cfg, const = _plan(arch, dim, rope_dim, heads, inverse, quant)
                sig = {"x_ptr": f"*{dtype}:D", "pos_ptr": "*i64:D", "inv_freq_ptr": "*fp32:D", "y_ptr": f"*{dtype}:D",
                       "x_token_stride": "i32:D", "x_head_stride": "i32:D", "scaling": "fp32"}
                variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("rope", _rope_kernel, aot_variants)


def rope_pairs(op: str, inv_freq: torch.Tensor, dim: int) -> int:
    """The number of rotated channel pairs, checked the way every kernel that rotates needs it: a power of two
    (one tile of pairs), at most half of the ``dim`` channels."""
    half = inv_freq.numel()
    if not coverage.rope_fits(inv_freq, dim):
        raise ValueError(f"{op}: {half} frequency pairs (a power of two, at most half of {dim}) expected")
    return half


def prepare(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
            inverse: bool = False, *, arch: CudaArch) -> Launch:
    """Plan ``rope(...)`` for ``arch``: output allocated, arguments built, nothing launched."""
    return plan_rope(x, positions, inv_freq, attention_scaling, inverse, arch=arch)


def plan_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
              inverse: bool, *, arch: CudaArch, quant: Quant = None, op: str = "rope") -> Launch:
    """The launch of ``rope``, or of a fused op with the ``quant`` epilogue (the caller checks its block divides
    the row's and the rope channels)."""
    dim = x.shape[-1]
    half = rope_pairs(op, inv_freq, dim)
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    tokens, heads, _ = x3.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    positions = positions.to(device=x.device, dtype=torch.int64).contiguous()
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    cfg, const = _plan(arch, dim, 2 * half, heads, bool(inverse), quant)
    args = dict(x_ptr=x3, pos_ptr=positions, inv_freq_ptr=inv_freq, y_ptr=y,
                x_token_stride=x3.stride(0) if tokens > 1 else heads * dim,
                x_head_stride=x3.stride(1) if heads > 1 else dim, scaling=float(attention_scaling), **const)
    return Launch((tokens, triton.cdiv(heads, const["BLOCK_H"])), cfg, args, y)


def covers(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
           inverse: bool = False) -> bool:
    return coverage.rope_fits(inv_freq, x.shape[-1])


@override("rope", coverage=covers, aot=(KERNEL,))
def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
         inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * len(inv_freq)`` channels of x [T, D] or [T, H, D] by position; returns a new tensor."""
    index, arch = cuda_target(x)
    return prepare(x, positions, inv_freq, attention_scaling, inverse, arch=arch).run(KERNEL, index)

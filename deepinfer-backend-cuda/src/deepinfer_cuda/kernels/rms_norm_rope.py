"""RMSNorm then partial interleaved RoPE, one Triton pass over rows of [T, D] or [T, H, D].

Overrides core's ``rms_norm_rope(x, weight, eps, positions, inv_freq, attention_scaling=1.0)``
(deepinfer/ops/rope.py): V4 normalises and rotates its per-head queries and its K=V latent, two launches each
as ``rms_norm`` + ``rope``; this is one.  [T, H, D] is T*H rows, row ``r`` at position ``positions[r // H]``.

Bits: the same as the two kernels composed (kernels/rms_norm.py, kernels/rope.py).  The row tile, its load and
its fp32 sum of squares are rms_norm's (same tile shape and warps, so the same reduction order); the normalised,
weighted row is rounded to x's dtype, as rms_norm stores it; the trailing ``2 * HALF`` channels are then reloaded
(L1/L2 hits), given the same normalisation and rounding, and rotated in fp32 exactly as rope does.  Each row is
reduced by itself, so results do not depend on the batch (batch-invariant).

``QUANT`` (constexpr; off for this op, so its cubins are unchanged in arithmetic): the epilogue of
``rms_norm_rope_fp8_e4m3_fake_quant`` (V4.1's window K=V): both stores go through ``fake_quant.quantize_rows``,
the block quantizer's one copy, applied to the values as rounded to x's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, LaunchConfig, rms_norm_rope_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.fake_quant import NO_QUANT, quant_constants, quantize_rows
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.rope import rope_pairs
from deepinfer_cuda.override import override

#: (head_dim, rope_dim, heads) compiled ahead of time: V4 queries (64 heads, unweighted) and the K=V latent (1,
#: fp32 weight) at head_dim 512; the lightning indexer's 128 (queries and keys) in case it fuses too.
AOT_SHAPES = ((512, 64, 64), (512, 64, 1), (128, 64, 64), (128, 64, 1))
AOT_DTYPES = ("bf16", "fp32")


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, inv_freq_ptr, y_ptr, x_token_stride, x_head_stride, n_rows, eps,
                          scaling, N: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, QUANT: tl.constexpr,
                          QBLOCK: tl.constexpr, FORMAT: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                          UE8M0_MUL: tl.constexpr, INTERPRETED: tl.constexpr):
    wait_for_producers()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    tokens = rows64 // HEADS
    src = (x_ptr + tokens * x_token_stride + (rows64 % HEADS) * x_head_stride)[:, None]
    dst = (y_ptr + rows64 * N)[:, None]
    # rms_norm's pass: the whole row, fp32 sum of squares; the leading N - 2*HALF channels are final here.
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * inv_rms[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = y * w[None, :]
    keep = mask & (cols < N - 2 * HALF)[None, :]
    y = y.to(y_ptr.dtype.element_ty)
    if QUANT:  # the fused op: the stored values, quantized per QBLOCK (blocks in the rope channels are not stored)
        y = quantize_rows(y.to(tl.float32), BLOCK_ROWS, BLOCK_N, QBLOCK, FORMAT, AMAX_FLOOR, UE8M0_MUL,
                          INTERPRETED).to(y_ptr.dtype.element_ty)
    tl.store(dst + cols[None, :], y, mask=keep)
    # rope's pass on the trailing 2*HALF channels, from the normalised values rounded as rms_norm stores them.
    rot_cols = N - 2 * HALF + tl.arange(0, 2 * HALF)
    r = tl.load(src + rot_cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * inv_rms[:, None]
    if HAS_WEIGHT:
        r = r * tl.load(w_ptr + rot_cols).to(tl.float32)[None, :]
    r = r.to(y_ptr.dtype.element_ty).to(tl.float32)
    pairs = tl.arange(0, HALF)
    position = tl.load(pos_ptr + tokens, mask=row_ok, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(inv_freq_ptr + pairs)[None, :]
    cos = libdevice.cos(angle) * scaling
    sin = libdevice.sin(angle) * scaling
    even, odd = tl.split(tl.reshape(r, (BLOCK_ROWS, HALF, 2)))
    out_even = even * cos - odd * sin
    out_odd = odd * cos + even * sin
    out = tl.reshape(tl.interleave(out_even, out_odd), (BLOCK_ROWS, 2 * HALF)).to(y_ptr.dtype.element_ty)
    if QUANT:
        out = quantize_rows(out.to(tl.float32), BLOCK_ROWS, 2 * HALF, QBLOCK, FORMAT, AMAX_FLOOR, UE8M0_MUL,
                            INTERPRETED).to(y_ptr.dtype.element_ty)
    tl.store(dst + rot_cols[None, :], out, mask=row_ok[:, None])


#: The QUANT epilogue's (block, format of kernels/fake_quant.py, interpreted); None: no quantizer.
Quant = tuple[int, int, bool] | None


@functools.cache
def _plan(arch: CudaArch, dim: int, rope_dim: int, heads: int, has_weight: bool,
          quant: Quant = None) -> tuple[LaunchConfig, dict[str, object]]:
    cfg = rms_norm_rope_config(arch, dim)
    return cfg, {"N": dim, "HALF": rope_dim // 2, "HEADS": heads, "BLOCK_N": max(16, triton.next_power_of_2(dim)),
                 "BLOCK_ROWS": cfg.block_rows, "HAS_WEIGHT": has_weight,
                 **(NO_QUANT if quant is None else quant_constants(*quant))}


def aot_variants(arch: CudaArch, shapes: tuple[tuple[int, int, int], ...] = AOT_SHAPES, quant: Quant = None,
                 weights: tuple[str | None, ...] = ("fp32", None)) -> list[Variant]:
    """Contiguous heads / rows with 16-divisible strides (the latent is a column slice of the layer's input
    projection, whose widths are multiples of 16); weight in x's dtype, fp32 (V4's norm weights) or none."""
    variants = []
    for dim, rope_dim, heads in shapes:
        for dtype in AOT_DTYPES:
            for weight in sorted({dtype, *weights}, key=str):
                cfg, const = _plan(arch, dim, rope_dim, heads, weight is not None, quant)
                const = dict(const)
                sig = {"x_ptr": f"*{dtype}:D"}
                if weight is None:
                    const["w_ptr"] = None
                else:
                    sig["w_ptr"] = f"*{weight}:D"
                sig.update({"pos_ptr": "*i64:D", "inv_freq_ptr": "*fp32:D", "y_ptr": f"*{dtype}:D",
                            "x_token_stride": "i32:D", "x_head_stride": "i32:D", "n_rows": "i32", "eps": "fp32",
                            "scaling": "fp32"})
                variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("rms_norm_rope", _rms_norm_rope_kernel, aot_variants)


def prepare(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
            inv_freq: torch.Tensor, attention_scaling: float = 1.0, *, arch: CudaArch) -> Launch:
    """Plan ``rms_norm_rope(...)`` for ``arch``: output allocated, arguments built, nothing launched."""
    return plan_rms_norm_rope(x, weight, eps, positions, inv_freq, attention_scaling, arch=arch)


def plan_rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                       inv_freq: torch.Tensor, attention_scaling: float, *, arch: CudaArch, quant: Quant = None,
                       op: str = "rms_norm_rope") -> Launch:
    """The launch of ``rms_norm_rope``, or of a fused op with the ``quant`` epilogue (the caller checks its block
    divides the row's and the rope channels)."""
    dim = x.shape[-1]
    half = rope_pairs(op, inv_freq, dim)
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    tokens, heads, _ = x3.shape
    n_rows = tokens * heads
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if weight is not None and weight.stride(-1) != 1:
        weight = weight.contiguous()
    positions = positions.to(device=x.device, dtype=torch.int64).contiguous()
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    cfg, const = _plan(arch, dim, 2 * half, heads, weight is not None, quant)
    args = dict(x_ptr=x3, w_ptr=weight, pos_ptr=positions, inv_freq_ptr=inv_freq, y_ptr=y,
                x_token_stride=x3.stride(0) if tokens > 1 else heads * dim,
                x_head_stride=x3.stride(1) if heads > 1 else dim, n_rows=n_rows, eps=float(eps),
                scaling=float(attention_scaling), **const)
    return Launch((triton.cdiv(n_rows, cfg.block_rows) if dim else 0,), cfg, args, y)


def covers(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
           attention_scaling: float = 1.0) -> bool:
    return coverage.rope_fits(inv_freq, x.shape[-1])


# batch-invariant: row-local (the window K=V's norm + rope), tiles from the model dims
@override("rms_norm_rope", coverage=covers, batch_invariant=True, aot=(KERNEL,))
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, D] or [T, H, D], rounded to x's dtype, then RoPE on its last
    ``2 * len(inv_freq)`` channels; returns a new tensor of x's shape and dtype."""
    index, arch = cuda_target(x)
    return prepare(x, weight, eps, positions, inv_freq, attention_scaling, arch=arch).run(KERNEL, index)

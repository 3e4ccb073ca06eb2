"""RMSNorm as one Triton pass: load a tile of rows, reduce in fp32, scale, store in the input dtype.

Overrides core's ``rms_norm(x, weight, eps)`` (deepinfer/ops/norm.py) with the same signature.
Each row is reduced by itself in a fixed order, so results do not depend on the batch (batch-invariant).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, rms_norm_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: Row widths compiled ahead of time: V4 hidden 4096, q_lora 1024, head 512, indexer head 128,
#: mHC's flattened 4 x 4096; V4.1 hidden 5120, q_lora 1280, 4 x 5120; 64 for small configs and tests.
AOT_DIMS = (64, 128, 512, 1024, 1280, 4096, 5120, 16384, 20480)
AOT_DTYPES = ("bf16", "fp32")


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_row_stride, y_row_stride, n_rows, eps,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    wait_for_producers()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * inv_rms[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _constexprs(dim: int, cfg: LaunchConfig, has_weight: bool) -> dict[str, object]:
    return {"N": dim, "BLOCK_N": max(16, triton.next_power_of_2(dim)), "BLOCK_ROWS": cfg.block_rows,
            "HAS_WEIGHT": has_weight}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """Contiguous rows (16-byte aligned pointers and strides); weight in the input's dtype, in fp32 (V4 keeps its
    norm weights in fp32 while activations are bf16) or none."""
    variants = []
    for dim in AOT_DIMS:
        cfg = rms_norm_config(arch, dim)
        for dtype in AOT_DTYPES:
            for weight in sorted({dtype, "fp32", None}, key=str):
                has_weight = weight is not None
                sig = {"x_ptr": f"*{dtype}:D"}
                if has_weight:
                    sig["w_ptr"] = f"*{weight}:D"
                sig.update({"y_ptr": f"*{dtype}:D", "x_row_stride": "i32:D", "y_row_stride": "i32:D",
                            "n_rows": "i32", "eps": "fp32"})
                const = _constexprs(dim, cfg, has_weight)
                if not has_weight:
                    const["w_ptr"] = None
                variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("rms_norm", _rms_norm_kernel, _aot_variants)


@functools.cache
def _plan(arch: CudaArch, dim: int, has_weight: bool) -> tuple[LaunchConfig, dict[str, object]]:
    cfg = rms_norm_config(arch, dim)
    return cfg, _constexprs(dim, cfg, has_weight)


def prepare(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, arch: CudaArch) -> Launch:
    """Plan ``rms_norm(x, weight, eps)`` for ``arch``: output allocated, arguments built, nothing launched."""
    dim = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, dim)
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, dim), dtype=x.dtype, device=x.device)
    if weight is not None and weight.stride(-1) != 1:
        weight = weight.contiguous()
    cfg, constexprs = _plan(arch, dim, weight is not None)
    args = dict(x_ptr=x2, w_ptr=weight, y_ptr=y, x_row_stride=x2.stride(0) if n_rows > 1 else dim,
                y_row_stride=dim, n_rows=n_rows, eps=float(eps), **constexprs)
    grid = ((n_rows + cfg.block_rows - 1) // cfg.block_rows if dim else 0,)
    return Launch(grid, cfg, args, y.view(x.shape))


@override("rms_norm", aot=(KERNEL,))
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, returned in ``x.dtype``; x [..., D], weight [D] or None."""
    index, arch = cuda_target(x)
    return prepare(x, weight, eps, arch=arch).run(KERNEL, index)

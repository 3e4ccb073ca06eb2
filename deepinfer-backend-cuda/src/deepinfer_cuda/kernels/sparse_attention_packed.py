"""Sparse attention over V4.1's packed state: ``sparse_attention.py``'s kernel with ``PACKED`` row loads.

Overrides core's ``sparse_attention_packed_inverse_rope(q, rings, entries, entry_base, indices, sinks, scale,
positions, inv_freq, attention_scaling, ring_block, entry_block, entry_scale_format)``
(deepinfer/ops/packed_attention.py).  The reference gathers and unpacks the attended rows, then attends; here each
chunk of gathered rows is decoded in registers (``packed_rows.py``: the unpack kernel's arithmetic, so the values
are the same bits) and fed to the same tile loop, split regimes and merge as ``sparse_attention``: no unpacked copy,
no extra launches, and a decode step reads 528 B (FP8 ring row) or 288 B (FP4 entry row) a key instead of 1 KiB.
The tiles are ``sparse_attention``'s, so the result is bit for bit the plain kernel's over the unpacked rows (the
bf16 state's logits); decoding 64-row chunks in registers costs it spills the plain kernel has less of (ptxas
counts and timings: docs/performance/log/2026-12-06.md).
"""

from __future__ import annotations

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, SparseAttentionTiles
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.sparse_attention import (
    COMBINE_KERNEL,
    _sparse_attention_kernel,
    attention_variants,
    plan_attention,
)
from deepinfer_cuda.override import override

#: (heads, head_dim) compiled ahead of time: V4.1-Flash 64 x 512 (and 128 x 512), with its 64 rope channels, its
#: formats (SWA FP8 + ue8m0 per 32, latents FP4 + e4m3 per 16).
AOT_SHAPES = ((64, 512), (128, 512))
AOT_ROPE_HALVES = (32,)
AOT_FORMATS = ((32, 16, "e4m3"),)
#: Triton's CPU interpreter: fp32 products and e4m3 decoded by arithmetic (it has no fp8 type).  Off on the GPU.
INTERPRETED = False


def _pool_constexprs(ring_block: int, entry_block: int, entry_scale_format: str, soft_fp8: bool) -> dict[str, object]:
    return {"PACKED": True, "RING_BLOCK": ring_block, "ENTRY_BLOCK": entry_block,
            "ENTRY_E4M3": entry_scale_format == "e4m3", "SOFT_FP8": soft_fp8}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants: list[Variant] = []
    for ring_block, entry_block, fmt in AOT_FORMATS:
        variants += attention_variants(arch, AOT_SHAPES, AOT_ROPE_HALVES,
                                       {"kv_ptr": "*u8:D", "entries_ptr": "*u8:D"},
                                       _pool_constexprs(ring_block, entry_block, fmt, False))
    return variants


KERNEL = TritonKernel("sparse_attention_packed_inverse_rope", _sparse_attention_kernel, _aot_variants)


def prepare(q: torch.Tensor, rings: torch.Tensor, entries: torch.Tensor, entry_base: int, indices: torch.Tensor,
            sinks: torch.Tensor, scale: float, positions: torch.Tensor, inv_freq: torch.Tensor,
            attention_scaling: float, ring_block: int, entry_block: int, entry_scale_format: ScaleFormat, *,
            arch: CudaArch, split: bool | None = None, tiles: SparseAttentionTiles | None = None) -> LaunchChain:
    """Plan the op for ``arch`` (nothing launched); ``split`` and ``tiles`` as ``sparse_attention.prepare``'s."""
    dim = q.shape[-1]
    if dim & (dim - 1) or dim < 32 or ring_block not in (16, 32) or entry_block not in (16, 32):
        raise ValueError(f"packed sparse attention: head_dim must be a power of two >= 32 and the blocks 16 or 32, "
                         f"got {dim}, {ring_block}, {entry_block}")
    if rings.shape[-1] != dim + dim // ring_block or entries.shape[-1] != dim // 2 + dim // entry_block:
        raise ValueError(f"packed rows of {rings.shape[-1]} / {entries.shape[-1]} bytes are not rows of {dim} values "
                         f"in blocks of {ring_block} / {entry_block}")
    rings = rings.contiguous()
    # A sliding-only layer has no entry rows: no index reaches entry_base, so the pointer is never read.
    entries = entries.contiguous() if entries.shape[0] else rings
    pool: dict[str, object] = dict(kv_ptr=rings, entries_ptr=entries, entry_base=int(entry_base))
    const = _pool_constexprs(ring_block, entry_block, entry_scale_format, INTERPRETED)
    return plan_attention(q.contiguous(), pool, const, indices, sinks, scale, positions, inv_freq, attention_scaling,
                          arch=arch, split=split, tiles=tiles, kernel=KERNEL, fp32_dot=INTERPRETED)


def covers(q: torch.Tensor, rings: torch.Tensor, entries: torch.Tensor, entry_base: int, indices: torch.Tensor,
           sinks: torch.Tensor, scale: float, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
           ring_block: int, entry_block: int, entry_scale_format: str) -> bool:
    """A packed row decodes as one power-of-two tile of channels (>= 32), in scale blocks of 16 or 32."""
    dim = q.shape[-1]
    return (coverage.rope_fits(inv_freq, dim) and coverage.is_pow2(dim) and dim >= 32 and ring_block in (16, 32)
            and entry_block in (16, 32))


# batch-invariant: sparse_attention's kernel (per query, fixed chunks), its rows decoded
@override("sparse_attention_packed_inverse_rope", coverage=covers, batch_invariant=True,
          aot=(KERNEL, COMBINE_KERNEL))
def sparse_attention_packed_inverse_rope(
    q: torch.Tensor, rings: torch.Tensor, entries: torch.Tensor, entry_base: int, indices: torch.Tensor,
    sinks: torch.Tensor, scale: float, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
    ring_block: int, entry_block: int, entry_scale_format: ScaleFormat,
) -> torch.Tensor:
    """q [T, H, D] attends to packed rows ``indices`` [T, K] (-1 = none) of ``rings`` / ``entries``; [T, H, D]."""
    index, arch = cuda_target(q)
    return prepare(q, rings, entries, entry_base, indices, sinks, scale, positions, inv_freq, attention_scaling,
                   ring_block, entry_block, entry_scale_format, arch=arch).run(index)

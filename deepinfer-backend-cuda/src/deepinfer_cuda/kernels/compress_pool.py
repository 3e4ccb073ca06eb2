"""The compressor's gated pooling as one Triton pass: slot softmax in fp32, weighted sum, one KV entry per window.

Overrides core's ``compress_pool(kv, score)`` (deepinfer/ops/compress.py).  One program holds one window's
``[slots, block_c]`` tile of scores and projections in registers: the softmax over the slots runs in fp32, the
weights are rounded to kv's dtype and multiplied there (as the reference does), and the products are summed in
fp32 and rounded once.  A program reads only its own window, so results do not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, compress_pool_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (slots, channels) compiled ahead of time: CSA (ratio 4: 2 x 4 slots), V4.1's ratios 2 and 1 (4 and 2 slots),
#: HCA (ratio 128), at head_dim 512 and the indexer's 128.
AOT_SHAPES = tuple((s, c) for s in (2, 4, 8, 128) for c in (128, 512))
AOT_DTYPES = ("bf16", "fp32")
#: Triton's CPU interpreter truncates fp32 -> bf16 casts; the interpreter test turns this on to round to nearest
#: even by hand (the same function the GPU computes).  Off on the GPU.
INTERPRETED = False


@triton.jit
def _rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``v`` (fp32) rounded to ``dtype`` and back to fp32."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _compress_pool_kernel(kv_ptr, score_ptr, out_ptr, S: tl.constexpr, C: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    wait_for_producers()
    window = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slots = tl.arange(0, BLOCK_S)
    mask = (slots < S)[:, None] & (cols < C)[None, :]
    offs = window * (S * C) + slots[:, None] * C + cols[None, :]
    score = tl.load(score_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(score - tl.max(score, axis=0)[None, :])  # an empty slot (-inf) weighs exactly 0
    dtype = out_ptr.dtype.element_ty
    weight = _rounded(e / tl.sum(e, axis=0)[None, :], dtype, INTERPRETED)
    kv = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pooled = tl.sum(_rounded(kv * weight, dtype, INTERPRETED), axis=0)
    tl.store(out_ptr + window * C + cols, _rounded(pooled, dtype, INTERPRETED).to(dtype), mask=cols < C)


def _constexprs(slots: int, dim: int, block_c: int) -> dict[str, object]:
    return {"S": slots, "C": dim, "BLOCK_S": max(2, triton.next_power_of_2(slots)), "BLOCK_C": block_c,
            "INTERPRETED": INTERPRETED}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """Contiguous kv in bf16 or fp32, fp32 scores, at the model's (slots, channels)."""
    variants = []
    for slots, dim in AOT_SHAPES:
        cfg, block_c = compress_pool_config(arch, slots, dim)
        for dtype in AOT_DTYPES:
            sig = {"kv_ptr": f"*{dtype}:D", "score_ptr": "*fp32:D", "out_ptr": f"*{dtype}:D"}
            variants.append(Variant(sig, _constexprs(slots, dim, block_c), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("compress_pool", _compress_pool_kernel, _aot_variants)


def prepare(kv: torch.Tensor, score: torch.Tensor, *, arch: CudaArch) -> Launch:
    """Plan ``compress_pool(kv, score)`` for ``arch``: output allocated, arguments built, nothing launched."""
    windows, slots, dim = kv.shape
    kv = kv.contiguous()
    score = score.to(torch.float32).contiguous()
    out = torch.empty((windows, dim), dtype=kv.dtype, device=kv.device)
    cfg, block_c = compress_pool_config(arch, slots, dim)
    args = dict(kv_ptr=kv, score_ptr=score, out_ptr=out, **_constexprs(slots, dim, block_c))
    return Launch((windows, triton.cdiv(dim, block_c)), cfg, args, out)


# batch-invariant: one program per window; checked on an H200
@override("compress_pool", batch_invariant=True, aot=(KERNEL,))
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Pooled entries [W, C] in kv.dtype of kv [W, S, C] weighted by a per-channel softmax of score [W, S, C]."""
    index, arch = cuda_target(kv)
    return prepare(kv, score, arch=arch).run(KERNEL, index)

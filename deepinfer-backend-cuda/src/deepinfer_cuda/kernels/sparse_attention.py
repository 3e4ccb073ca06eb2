"""Sparse attention with sinks over a shared K=V pool: gathered rows, online softmax, tensor-core products.

Overrides core's ``sparse_attention(q, kv, indices, sinks, scale)`` (deepinfer/ops/attention.py).  The reference
gathers every query's keys into a [T, K, D] fp32 tensor and multiplies without tensor cores; here one program
takes one query and a block of its heads (V4 has one KV head, so the heads share every gathered row):

    m, l, acc = sink_h, 1, 0                      per head; the sink joins the denominator, adds no value
    for each chunk of BLOCK_N index columns:      fixed chunks from column 0
        k = kv[idx]                               [BLOCK_N, D] gathered once for BLOCK_H heads (-1 -> masked)
        s = (q @ k^T) * scale                     tensor cores (bf16 in, fp32 accumulate)
        m' = max(m, max s); p = exp(s - m'); l = l * exp(m - m') + sum p; acc = acc * exp(m - m') + p @ k
    out = acc / l

Batch-invariant: a program reads only its own query's row of ``indices``, the chunking is fixed, and the chunks
other queries' padding adds are all masked (p = 0, exp(m - m') = 1 exactly), so a row's bits do not depend on
the batch.  fp32 inputs use IEEE fp32 products (not TF32), as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, sparse_attention_config
from deepinfer_cuda.kernel_set.compile import Variant
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target

#: (heads, head_dim) compiled ahead of time: V4-Flash / V4.1-Flash 64 x 512, and 128 x 512 (V4-Pro width).
AOT_SHAPES = ((64, 512), (128, 512))
#: Work around Triton's CPU interpreter, which computes bf16 ``tl.dot`` wrongly: multiply in fp32 (bf16 products
#: are exact in fp32).  Off on the GPU, turned on by the interpreter test.
INTERPRETED = False


@triton.jit(do_not_specialize=["width"])
def _sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sinks_ptr, out_ptr, width, scale,
                             H: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q_offs = t * (H * D) + heads[:, None] * D + dims[None, :]
    q_mask = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)  # running max, starts at the sink
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, width, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * width + cols, mask=cols < width, other=-1)
        valid = idx >= 0
        k = tl.load(kv_ptr + tl.maximum(idx, 0).to(tl.int64)[:, None] * D + dims[None, :],
                    mask=valid[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D], K = V
        if FP32_DOT:
            k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = tl.dot(p, k, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _constexprs(heads: int, dim: int, block_h: int, block_n: int, fp32: bool) -> dict[str, object]:
    return {"H": heads, "D": dim, "FP32_DOT": fp32 or INTERPRETED, "BLOCK_H": block_h,
            "BLOCK_D": max(16, triton.next_power_of_2(dim)), "BLOCK_N": block_n}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """Contiguous bf16 queries and pool, int64 indices, fp32 sinks at the model shapes."""
    variants = []
    for heads, dim in AOT_SHAPES:
        cfg, block_h, block_n = sparse_attention_config(arch, heads, dim, 2)
        sig = {"q_ptr": "*bf16:D", "kv_ptr": "*bf16:D", "idx_ptr": "*i64:D", "sinks_ptr": "*fp32:D",
               "out_ptr": "*bf16:D", "width": "i32", "scale": "fp32"}
        variants.append(Variant(sig, _constexprs(heads, dim, block_h, block_n, False), cfg.num_warps,
                                cfg.num_stages))
    return variants


KERNEL = TritonKernel("sparse_attention", _sparse_attention_kernel, _aot_variants)


def prepare(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float, *,
            arch: CudaArch) -> Launch:
    """Plan ``sparse_attention(q, kv, indices, sinks, scale)`` for ``arch``: output allocated, nothing launched."""
    tokens, heads, dim = q.shape
    q, kv = q.contiguous(), kv.to(q.dtype).contiguous()
    indices = indices.to(torch.int64).contiguous()
    sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty_like(q)
    cfg, block_h, block_n = sparse_attention_config(arch, heads, dim, q.element_size())
    args = dict(q_ptr=q, kv_ptr=kv, idx_ptr=indices, sinks_ptr=sinks, out_ptr=out, width=indices.shape[1],
                scale=float(scale), **_constexprs(heads, dim, block_h, block_n, q.dtype == torch.float32))
    return Launch((tokens, triton.cdiv(heads, block_h)), cfg, args, out)


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D] attends to rows ``indices`` [T, K] (-1 = none) of the K=V pool kv [P, D], sinks [H]; [T, H, D]."""
    index, arch = cuda_target(q)
    return prepare(q, kv, indices, sinks, scale, arch=arch).run(KERNEL, index)

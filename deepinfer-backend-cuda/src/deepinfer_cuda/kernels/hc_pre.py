"""mHC pre as one Triton program per token: norm, projection, gates, Sinkhorn and collapse in one pass.

Overrides core's ``hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)`` (deepinfer/ops/mhc.py).
The reference materialises an fp32 copy of the flattened streams, normalises it, runs an fp32 GEMM to 24
mixes, and then ~4 small kernels per Sinkhorn round.  Here the RMS normalisation is folded into the projection
(``norm(x) . w = rsqrt(mean(x^2) + eps) * (x . w)``), the (2+N)*N rows of ``fn`` stream from L2 against the
token's streams in fp32, and the gates, Sinkhorn rounds and the ``pre``-weighted collapse run in registers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, hc_pre_config
from deepinfer_cuda.kernel_set.compile import Variant
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target

#: (streams, hidden) compiled ahead of time: V4 (4 x 4096) and V4.1 (4 x 5120).
AOT_SHAPES = ((4, 4096), (4, 5120))
AOT_DTYPES = ("bf16", "fp32")


@triton.jit(do_not_specialize=["sinkhorn_iters"])
def _hc_pre_kernel(streams_ptr, fn_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr, comb_ptr,
                   norm_eps, hc_eps, sinkhorn_iters,
                   N: tl.constexpr, D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    K: tl.constexpr = N * D
    token = tl.program_id(0).to(tl.int64)
    src = streams_ptr + token * K
    ks = tl.arange(0, N)
    # fn rows: [0, N) pre, [N, 2N) post, [2N, 2N + N*N) comb (row-major N x N).
    pre_rows = ks[:, None].to(tl.int64) * K
    post_rows = (N + ks[:, None]).to(tl.int64) * K
    comb_rows = (2 * N + ks[:, None, None] * N + ks[None, :, None]).to(tl.int64) * K
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc_pre = tl.zeros([N, BLOCK_K], dtype=tl.float32)
    acc_post = tl.zeros([N, BLOCK_K], dtype=tl.float32)
    acc_comb = tl.zeros([N, N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = cols < K
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        sumsq += x * x
        acc_pre += tl.load(fn_ptr + pre_rows + cols[None, :], mask=ok[None, :], other=0.0) * x[None, :]
        acc_post += tl.load(fn_ptr + post_rows + cols[None, :], mask=ok[None, :], other=0.0) * x[None, :]
        acc_comb += tl.load(fn_ptr + comb_rows + cols[None, None, :], mask=ok[None, None, :], other=0.0) \
            * x[None, None, :]
    inv_rms = tl.rsqrt(tl.sum(sumsq, axis=0) / K + norm_eps)
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.sum(acc_pre, axis=1) * inv_rms * pre_s + tl.load(base_ptr + ks)) + hc_eps
    post = 2 * tl.sigmoid(tl.sum(acc_post, axis=1) * inv_rms * post_s + tl.load(base_ptr + N + ks))
    logits = tl.sum(acc_comb, axis=2) * inv_rms * comb_s + tl.load(base_ptr + 2 * N + ks[:, None] * N + ks[None, :])
    # Softmax over each row (the reference's dim=-1), then Sinkhorn: columns once, then rows/columns rounds.
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + token * N + ks, post)
    tl.store(comb_ptr + token * N * N + ks[:, None] * N + ks[None, :], comb)
    # Collapse the streams with pre (fp32 products, summed, rounded once to the stream dtype).
    for d0 in range(0, D, BLOCK_D):
        dcols = d0 + tl.arange(0, BLOCK_D)
        dok = dcols < D
        s = tl.load(src + ks[:, None] * D + dcols[None, :], mask=dok[None, :], other=0.0).to(tl.float32)
        out = tl.sum(pre[:, None] * s, axis=0)
        tl.store(collapsed_ptr + token * D + dcols, out.to(collapsed_ptr.dtype.element_ty), mask=dok)


@functools.cache
def _plan(arch: CudaArch, n: int, dim: int) -> tuple[LaunchConfig, dict[str, object]]:
    cfg, block_k, block_d = hc_pre_config(arch, n, dim)
    return cfg, {"N": n, "D": dim, "BLOCK_K": block_k, "BLOCK_D": block_d}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for n, dim in AOT_SHAPES:
        cfg, const = _plan(arch, n, dim)
        for dtype in AOT_DTYPES:
            sig = {"streams_ptr": f"*{dtype}:D", "fn_ptr": "*fp32:D", "base_ptr": "*fp32:D", "scale_ptr": "*fp32:D",
                   "collapsed_ptr": f"*{dtype}:D", "post_ptr": "*fp32:D", "comb_ptr": "*fp32:D",
                   "norm_eps": "fp32", "hc_eps": "fp32", "sinkhorn_iters": "i32"}
            variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("hc_pre", _hc_pre_kernel, _aot_variants)


def prepare(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, sinkhorn_iters: int, *, arch: CudaArch) -> Launch:
    """Plan ``hc_pre(...)`` for ``arch``: outputs allocated, arguments built, nothing launched."""
    tokens, n, dim = streams.shape
    if n & (n - 1) or sinkhorn_iters < 1:
        raise ValueError(f"hc_pre: needs a power-of-two stream count (got {n}) and sinkhorn_iters >= 1")
    streams = streams.contiguous()
    fn, base, scale = (t.to(torch.float32).contiguous() for t in (fn, base, scale))
    collapsed = torch.empty((tokens, dim), dtype=streams.dtype, device=streams.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=streams.device)
    cfg, const = _plan(arch, n, dim)
    args = dict(streams_ptr=streams, fn_ptr=fn, base_ptr=base, scale_ptr=scale, collapsed_ptr=collapsed,
                post_ptr=post, comb_ptr=comb, norm_eps=float(norm_eps), hc_eps=float(hc_eps),
                sinkhorn_iters=int(sinkhorn_iters), **const)
    return Launch((tokens,), cfg, args, (collapsed, post, comb))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(collapsed [T, D] in streams.dtype, post [T, N] fp32, comb [T, N, N] fp32) of one mHC site."""
    index, arch = cuda_target(streams)
    return prepare(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, arch=arch).run(KERNEL, index)

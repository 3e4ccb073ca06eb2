"""Manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams per token.

Before each sublayer ``hc_pre`` reads the streams and returns the sublayer input (streams collapsed with
``pre``) and the two mixing weights; after it, ``hc_post`` writes ``post * out + comb^T @ streams`` back.
``hc_head`` is the final collapse before the model's last norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.norm import rms_norm
from deepinfer.ops.registry import OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles

#: (tokens, streams, hidden) of the samples: V4's 4 streams, then V4.1's 2 and 3 (a kernel may cover only powers of
#: two; the conformance suite checks the reference runs what it does not cover).
STREAM_SHAPES = [(3, 4, 64), (17, 4, 256), (4, 2, 64), (5, 3, 64)]


def _hc_params(n: int, dim: int, outputs: int, gen: torch.Generator):
    fn = torch.randn(outputs, n * dim, generator=gen) * 0.05
    base = torch.randn(outputs, generator=gen) * 0.5
    return fn, base


def _hc_pre_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, n, dim in STREAM_SHAPES:
        streams = torch.randn(rows, n, dim, generator=gen).to(dtype)
        fn, base = _hc_params(n, dim, (2 + n) * n, gen)
        scale = 1 + 0.1 * torch.randn(3, generator=gen)
        yield OpSample((streams, fn, base, scale, 1e-6, 1e-6, 20), label=f"{rows}x{n}x{dim}")


@reference_op(sample_inputs=_hc_pre_samples, rows=(0,))
def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixing weights of one mHC site and the collapsed sublayer input.

    streams: [T, N, D] (model dtype); fn: [(2+N)*N, N*D] fp32; base: [(2+N)*N] fp32; scale: [3] fp32
    (pre, post, comb).  The flattened streams are RMS-normalised (unweighted) and projected by ``fn``;
    ``pre = sigmoid(.) + hc_eps``, ``post = 2 * sigmoid(.)``, ``comb = softmax(.) + hc_eps`` then Sinkhorn
    (column-normalise once, then ``sinkhorn_iters - 1`` row/column rounds) towards doubly stochastic.
    Returns ``(collapsed [T, D] in streams.dtype, post [T, N] fp32, comb [T, N, N] fp32)``.
    """
    pre, post, comb = _mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return hc_collapse(streams, pre), post, comb


def _mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, N], post [T, N], comb [T, N, N]) of one site, fp32 (see :func:`hc_pre`)."""
    rows, n, _ = streams.shape
    flat = rms_norm(streams.reshape(rows, -1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)

    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(rows, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


@batch_invariant_reference(hc_pre)
def hc_pre_in_tiles(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """The mixing projection on fixed tiles of 16 tokens (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(hc_pre, (streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters), (0,))


def _hc_pre_single_pass_samples(dtype: torch.dtype, gen: torch.Generator):
    for sample in _hc_pre_samples(dtype, gen):
        streams = sample.args[0]
        previous = torch.sigmoid(torch.randn(streams.shape[0], streams.shape[1], generator=gen)) + 1e-6
        yield OpSample((streams, previous, *sample.args[1:]), label=sample.label)
    streams = torch.randn(5, 2, 32, generator=gen).to(dtype)  # the first layer: a one-hot collapse
    fn, base = _hc_params(2, 32, 8, gen)
    one_hot = torch.tensor([[1.0, 0.0]]).expand(5, -1)
    yield OpSample((streams, one_hot, fn, base, torch.ones(3), 1e-20, 1e-6, 20), label="5x2x32 one-hot")


@reference_op(sample_inputs=_hc_pre_single_pass_samples, rows=(0, 1))
def hc_pre_single_pass(
    streams: torch.Tensor,
    previous_pre: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site of single-pass mHC (V4.1): the sublayer input is the streams collapsed with the *previous*
    site's ``pre``, and this site's ``pre`` is returned for the next site.

    streams, fn, base, scale and the mixing weights as in :func:`hc_pre`; previous_pre: [T, N] fp32 (the first
    site's: one-hot on stream 0, which collapses to stream 0 exactly).  Returns ``(collapsed [T, D] in
    streams.dtype, pre [T, N], post [T, N], comb [T, N, N])``, the weights fp32.
    """
    pre, post, comb = _mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return hc_collapse(streams, previous_pre), pre, post, comb


@batch_invariant_reference(hc_pre_single_pass)
def hc_pre_single_pass_in_tiles(streams, previous_pre, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """The mixing projection on fixed tiles of 16 tokens (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(hc_pre_single_pass, (streams, previous_pre, fn, base, scale, norm_eps, hc_eps,
                                             sinkhorn_iters), (0, 1))


def _hc_collapse_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, n, dim in [(3, 4, 64), (17, 2, 256)]:
        streams = torch.randn(rows, n, dim, generator=gen).to(dtype)
        yield OpSample((streams, torch.rand(rows, n, generator=gen)), label=f"{rows}x{n}x{dim}")


@reference_op(sample_inputs=_hc_collapse_samples, rows=(0, 1))
def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_k pre[k] * streams[k]`` in fp32: streams [T, N, D]; pre [T, N] fp32.  Returns [T, D] in
    streams.dtype (V4.1's final collapse before the norm, with the last site's ``pre``)."""
    return (pre.float().unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


@batch_invariant_reference(hc_collapse)
def hc_collapse_in_tiles(streams, pre):
    """The collapse on fixed tiles of 16 tokens: how the reduction over streams is vectorised depends on the
    number of tokens."""
    return in_row_tiles(hc_collapse, (streams, pre), (0, 1))


def _hc_post_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, n, dim in STREAM_SHAPES:
        out = torch.randn(rows, dim, generator=gen).to(dtype)
        streams = torch.randn(rows, n, dim, generator=gen).to(dtype)
        post = 2 * torch.rand(rows, n, generator=gen)
        comb = torch.softmax(torch.randn(rows, n, n, generator=gen), dim=-1)
        yield OpSample((out, streams, post, comb), label=f"{rows}x{n}x{dim}")


@reference_op(sample_inputs=_hc_post_samples, rows=(0, 1, 2, 3))
def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams after a sublayer: ``new[k] = post[k] * out + sum_j comb[j, k] * streams[j]``.

    out: [T, D]; streams: [T, N, D] (same dtype); post: [T, N] fp32; comb: [T, N, N] fp32.
    Weights are cast to the stream dtype first, as the checkpoint's reference does.  Returns [T, N, D].
    """
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@batch_invariant_reference(hc_post)
def hc_post_in_tiles(out, streams, post, comb):
    """The per-token stream mixing (a batched GEMM) on fixed tiles of 16 tokens."""
    return in_row_tiles(hc_post, (out, streams, post, comb), (0, 1, 2, 3))


def _hc_head_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, n, dim in STREAM_SHAPES:
        streams = torch.randn(rows, n, dim, generator=gen).to(dtype)
        fn, base = _hc_params(n, dim, n, gen)
        scale = 1 + 0.1 * torch.randn(1, generator=gen)
        yield OpSample((streams, fn, base, scale, 1e-6, 1e-6), label=f"{rows}x{n}x{dim}")


@reference_op(sample_inputs=_hc_head_samples, rows=(0,))
def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    """Final collapse of the streams: ``sum_k pre_k * streams[k]``.

    ``pre = sigmoid(fn . norm(streams) * scale + base) + hc_eps`` (unweighted RMSNorm of the flattened streams).

    streams: [T, N, D]; fn: [N, N*D] fp32; base: [N] fp32; scale: [1] fp32.  Returns [T, D] in streams.dtype.
    """
    rows = streams.shape[0]
    flat = rms_norm(streams.reshape(rows, -1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


@batch_invariant_reference(hc_head)
def hc_head_in_tiles(streams, fn, base, scale, norm_eps, hc_eps):
    """The mixing projection on fixed tiles of 16 tokens (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(hc_head, (streams, fn, base, scale, norm_eps, hc_eps), (0,))

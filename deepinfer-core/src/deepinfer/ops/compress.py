"""Gated pooling: the compressor's reduction of a window of token projections to one KV entry."""

from __future__ import annotations

import torch

from deepinfer.ops.norm import rms_norm
from deepinfer.ops.registry import OpSample, Rows, batch_invariant_reference, reference_op
from deepinfer.ops.rope import rope
from deepinfer.ops.row_tiles import in_row_tiles


def _compress_pool_samples(dtype: torch.dtype, gen: torch.Generator):
    for windows, slots, dim in [(1, 8, 32), (13, 8, 512), (3, 128, 64)]:
        kv = torch.randn(windows, slots, dim, generator=gen).to(dtype)
        score = torch.randn(windows, slots, dim, generator=gen)
        yield OpSample((kv, score), label=f"{windows}x{slots}x{dim}")
        # CSA's first window has no predecessor: its first half is empty (zero kv, -inf score).
        kv0, score0 = kv.clone(), score.clone()
        kv0[0, : slots // 2], score0[0, : slots // 2] = 0, float("-inf")
        yield OpSample((kv0, score0), label=f"{windows}x{slots}x{dim} empty half")


@reference_op(sample_inputs=_compress_pool_samples, rows=(0, 1))
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Per channel, a softmax over a window's slots of ``score`` weighs the slots of ``kv``.

    kv: [W, S, C] (model dtype); score: [W, S, C] fp32 (gate projection + learned position bias; ``-inf``
    marks an empty slot, which gets weight 0).  The softmax runs in fp32; the weighted sum in kv.dtype.
    Returns [W, C] in kv.dtype.  (CSA lays out 2m slots: the previous window's series a, then this window's
    series b; HCA m slots.)
    """
    weights = torch.softmax(score.float(), dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)


@batch_invariant_reference(compress_pool)
def compress_pool_in_tiles(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Fixed tiles of 16 windows: CUDA's softmax and sum over the slots pick their kernel by the whole shape
    (measured on an H200: fp32 results change with the number of windows)."""
    return in_row_tiles(compress_pool, (kv, score), rows=(0, 1))


# --- the whole entry: slots, pooling, norm, rotation ------------------------------------------------------------
def _compress_entries_samples(dtype: torch.dtype, gen: torch.Generator):
    # (windows, ratio, dim, overlap, predecessors): V4's CSA (ratio 4, overlap) at head dim 512 and the indexer's
    # 128, HCA (ratio 128) at 512, a ratio-4 compressor without overlap; predecessors None (every window has one)
    # or a mask with missing ones (a sequence's first window).
    # Last, 12 rotated pairs (not a power of two).
    cases = [(3, 4, 512, True, [False, True, True], 64), (5, 4, 128, True, None, 64),
             (4, 4, 128, True, [True, False] * 2, 64), (2, 128, 512, False, None, 64), (3, 4, 128, False, None, 64),
             (3, 4, 128, True, None, 24)]
    for n, r, dim, overlap, predecessors, rope_dim in cases:
        inv_freq = 1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        width = 2 * dim if overlap else dim
        window = torch.randn(n, r, 2 * width, generator=gen).to(dtype)
        previous = torch.randn(n, r, 2 * dim, generator=gen).to(dtype) if overlap else None
        has_previous = None if predecessors is None else torch.tensor(predecessors)
        bias = torch.randn(r, width, generator=gen)
        norm_weight = 1 + 0.1 * torch.randn(dim, generator=gen)
        positions = r * torch.randint(0, 4096, (n,), generator=gen)
        scaling = 1.0 if r == 4 else 0.75
        label = f"{n}x{r}x{dim}{' overlap' if overlap else ''}{' first windows' if predecessors else ''}"
        label += f" rope {rope_dim}"
        args = (window, previous, has_previous, bias, norm_weight, 1e-6, positions, inv_freq, scaling)
        yield OpSample(args, label=label)
        if n > 1:  # decode: only the windows that close at this token are needed
            needed = torch.arange(n) % 2 == 0
            yield OpSample(args, {"needed": needed}, label=label + " needed mask")


def _select_windows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    """The sub-batch of windows ``rows`` (``previous`` and ``has_previous`` may be None)."""
    args = tuple(a[rows] if i in (0, 1, 2, 6) and a is not None else a for i, a in enumerate(sample.args))
    kwargs = {k: v[rows] if k == "needed" else v for k, v in sample.kwargs.items()}
    return OpSample(args, kwargs, sample.label)


def _slots(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
           position_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooling slots (kv, fp32 score) ``[n, S, dim]`` of windows (see :func:`compress_entries`)."""
    width = position_bias.shape[-1]
    kv, score = window[..., :width], window[..., width:] + position_bias  # fp32 (the bias is): exact promotion
    if previous is None:
        return kv, score
    dim = width // 2
    prev_score = previous[..., dim:] + position_bias[:, :dim]
    if has_previous is not None:
        prev_score = torch.where(has_previous[:, None, None], prev_score, float("-inf"))
    return torch.cat([previous[..., :dim], kv[..., dim:]], dim=1), torch.cat([prev_score, score[..., dim:]], dim=1)


def _entries(pool, window, previous, has_previous, position_bias, norm_weight, eps, positions, inv_freq,
             rope_scaling, needed) -> torch.Tensor:
    """Pool (with ``pool``: the plain or the tiled form), normalise, rotate; zero the rows not needed."""
    pooled = pool(*_slots(window, previous, has_previous, position_bias))
    entries = rope(rms_norm(pooled, norm_weight, eps), positions, inv_freq, rope_scaling)
    return entries if needed is None else torch.where(needed[:, None], entries, 0)


@reference_op(sample_inputs=_compress_entries_samples, rows=Rows((0, 1, 2, 6), narrow=_select_windows))
def compress_entries(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
                     position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     inv_freq: torch.Tensor, rope_scaling: float, needed: torch.Tensor | None = None) -> torch.Tensor:
    """The compressor's KV entries of closed windows: gated pooling, RMSNorm, RoPE at the window's position.

    window: [n, r, 2 * width] (kv | gate projections of the window's r tokens, model dtype).  Without overlap
    (HCA) width = dim and the r slots are the window's own.  With overlap (CSA, ``previous`` given) width =
    2 * dim holds series a | b: the 2r slots are series a of the predecessor (``previous`` [n, r, 2 * dim],
    kv | gate) then series b of the window; ``has_previous`` [n] bool (or None: every window has a predecessor)
    is false where there is none, whose r slots then weigh 0 (ignored without overlap).
    position_bias: [r, width] fp32, added to the gates (scores in fp32); norm_weight: [dim] (fp32 in V4);
    positions: [n] int64, each entry's RoPE position (its window's first token); inv_freq: [R/2] fp32 rotating
    the last R channels; rope_scaling: cos/sin scale.  Returns [n, dim] in window.dtype: pooled
    (:func:`compress_pool`), normalised (``rms_norm``) and rotated (``rope``), each rounded to the model dtype.
    needed: [n] bool or None: rows where it is false are zeros, so a backend may skip their windows (a decode
    step pools every row's window at fixed shape, but only windows that close at the token become entries).
    """
    return _entries(compress_pool, window, previous, has_previous, position_bias, norm_weight, eps, positions,
                    inv_freq, rope_scaling, needed)


@batch_invariant_reference(compress_entries)
def compress_entries_in_tiles(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
                              position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              positions: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float,
                              needed: torch.Tensor | None = None) -> torch.Tensor:
    """The same entries, pooled by :func:`compress_pool_in_tiles` (the rest is elementwise or per row)."""
    return _entries(compress_pool_in_tiles, window, previous, has_previous, position_bias, norm_weight, eps,
                    positions, inv_freq, rope_scaling, needed)

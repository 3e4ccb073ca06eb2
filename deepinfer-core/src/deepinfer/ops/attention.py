"""Sparse attention with sinks: each query attends to its own list of rows of a shared KV pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import OpSample, Rows, batch_invariant_reference, reference_op
from deepinfer.ops.rope import rope
from deepinfer.ops.row_tiles import fixed_chunks, in_row_tiles, padded_width

#: Queries per block in the reference, bounding the gathered [block, K, D] keys.
_QUERY_BLOCK = 256


def _sparse_attention_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, heads, dim, pool, width in [(4, 4, 64, 20, 12), (17, 16, 512, 300, 160)]:  # 17: two 16-row tiles
        q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
        kv = torch.randn(pool, dim, generator=gen).to(dtype)
        indices = torch.randint(0, pool, (rows, width), generator=gen)
        indices[torch.rand(rows, width, generator=gen) < 0.3] = -1
        indices[:, 0] = torch.randint(0, pool, (rows,), generator=gen)  # every query sees at least one row
        sinks = torch.randn(heads, generator=gen)
        yield OpSample((q, kv, indices, sinks, dim**-0.5), label=f"{rows}x{heads}x{dim} K={width}")
    # A ragged batch as the engine builds it: each query's list ends early, the rest is -1 padding.
    rows, heads, dim, pool, width = 21, 8, 128, 200, 150
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(pool, dim, generator=gen).to(dtype)
    indices = torch.randint(0, pool, (rows, width), generator=gen)
    ends = torch.randint(1, width + 1, (rows,), generator=gen)
    indices[torch.arange(width)[None, :] >= ends[:, None]] = -1
    sinks = torch.randn(heads, generator=gen)
    yield OpSample((q, kv, indices, sinks, dim**-0.5), label=f"{rows}x{heads}x{dim} ragged K<={width}")


def _attention_rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    """Keep ``rows`` of the queries and trim index columns no kept query uses (padding other queries added)."""
    q, kv, indices, sinks, scale = sample.args
    idx = indices[rows]
    used = (idx >= 0).any(dim=0).nonzero()
    width = int(used.max()) + 1 if used.numel() else 1
    return OpSample((q[rows], kv, idx[:, :width], sinks, scale), dict(sample.kwargs), sample.label)


@reference_op(sample_inputs=_sparse_attention_samples, rows=Rows((0, 2), _attention_rows))
def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Multi-query attention where keys and values are the same rows (V4's shared K=V latent).

    q: [T, H, D]; kv: [P, D] pool of every row any query may see (SWA window rows and compressed entries);
    indices: [T, K] int64 rows of the pool per query, ``-1`` = unused slot; sinks: [H] fp32 per-head sink
    logit, which joins the softmax's denominator but contributes no value.  Logits and softmax in fp32.
    Returns [T, H, D] in q.dtype.  A query with no valid index returns zeros.
    """
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        rows = slice(start, start + _QUERY_BLOCK)
        idx = indices[rows]
        keys = kv[idx.clamp(min=0)].float()  # [t, K, D]
        logits = torch.einsum("thd,tkd->thk", q[rows].float(), keys) * scale
        logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        out[rows] = torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
    return out


def _attend_in_chunks(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """One tile of queries, keys taken in fixed chunks of columns; the softmax's sums run chunk after chunk."""
    last = int((indices >= 0).any(dim=0).nonzero().max()) + 1 if bool((indices >= 0).any()) else 1
    chunks = fixed_chunks(last)
    qf = q.float()
    keys, logits = [], []
    for cols in chunks:
        idx = indices[:, cols]
        k = kv[idx.clamp(min=0)].float()  # [t, C, D]
        keys.append(k)
        logits.append((torch.einsum("thd,tcd->thc", qf, k) * scale).masked_fill((idx < 0).unsqueeze(1), float("-inf")))
    sink = sinks.float().view(1, -1).expand(q.shape[0], -1)  # [t, H]
    top = sink
    for chunk in logits:
        top = torch.maximum(top, chunk.amax(dim=-1))
    total = torch.exp(sink - top)
    weights = []
    for chunk in logits:
        w = torch.exp(chunk - top.unsqueeze(-1))
        total = total + w.sum(dim=-1)
        weights.append(w)
    out = torch.zeros_like(qf)
    for w, k in zip(weights, keys, strict=True):
        out = out + torch.einsum("thc,tcd->thd", w / total.unsqueeze(-1), k)
    return out.to(q.dtype)


@batch_invariant_reference(sparse_attention)
def sparse_attention_fixed_order(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Fixed tiles of 16 queries and fixed chunks of 64 key slots: the index width, which the longest
    sequence of the batch sets, only appends all-masked chunks, whose exact zeros change no sum."""
    width = padded_width(indices.shape[1])
    indices = F.pad(indices, (0, width - indices.shape[1]), value=-1)
    return in_row_tiles(_attend_in_chunks, (q, kv, indices, sinks, scale), rows=(0, 2))


def _inverse_rope_samples(dtype: torch.dtype, gen: torch.Generator):
    def rotated(sample: OpSample, rope_dim: int) -> OpSample:
        positions = torch.randint(0, 1 << 16, (sample.args[0].shape[0],), generator=gen)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        return OpSample(sample.args + (positions, inv_freq, 1.0), label=sample.label + f" rope {rope_dim}")

    for sample in _sparse_attention_samples(dtype, gen):
        yield rotated(sample, min(64, sample.args[0].shape[-1] // 4))
    yield rotated(sample, 24)  # 12 pairs: not a power of two


def _inverse_rope_rows(sample: OpSample, rows: torch.Tensor) -> OpSample:
    kept = _attention_rows(OpSample(sample.args[:5], {}, sample.label), rows)
    return OpSample(kept.args + (sample.args[5][rows],) + sample.args[6:], dict(sample.kwargs), sample.label)


@reference_op(sample_inputs=_inverse_rope_samples, rows=Rows((0, 2, 5), _inverse_rope_rows))
def sparse_attention_inverse_rope(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
) -> torch.Tensor:
    """:func:`sparse_attention`, then its output's rope channels rotated back (``rope(..., inverse=True)`` at
    each query's position): V4's values carry the keys' rotation.  One op so a backend can rotate in the
    attention kernel's epilogue instead of another pass over [T, H, D].  positions: [T] int64."""
    return rope(sparse_attention(q, kv, indices, sinks, scale), positions, inv_freq, attention_scaling, inverse=True)


@batch_invariant_reference(sparse_attention_inverse_rope)
def sparse_attention_inverse_rope_fixed_order(q, kv, indices, sinks, scale, positions, inv_freq,
                                              attention_scaling=1.0):
    """The batch-invariant attention, then the row-local rotation."""
    out = sparse_attention_fixed_order(q, kv, indices, sinks, scale)
    return rope(out, positions, inv_freq, attention_scaling, inverse=True)

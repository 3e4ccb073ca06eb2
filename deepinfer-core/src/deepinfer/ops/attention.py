"""Sparse attention with sinks: each query attends to its own list of rows of a shared KV pool."""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, reference_op

#: Queries per block in the reference, bounding the gathered [block, K, D] keys.
_QUERY_BLOCK = 256


def _sparse_attention_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, heads, dim, pool, width in [(4, 4, 64, 20, 12), (33, 16, 512, 300, 160)]:
        q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
        kv = torch.randn(pool, dim, generator=gen).to(dtype)
        indices = torch.randint(0, pool, (rows, width), generator=gen)
        indices[torch.rand(rows, width, generator=gen) < 0.3] = -1
        indices[:, 0] = torch.randint(0, pool, (rows,), generator=gen)  # every query sees at least one row
        sinks = torch.randn(heads, generator=gen)
        yield OpSample((q, kv, indices, sinks, dim**-0.5), label=f"{rows}x{heads}x{dim} K={width}")


@reference_op(sample_inputs=_sparse_attention_samples)
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

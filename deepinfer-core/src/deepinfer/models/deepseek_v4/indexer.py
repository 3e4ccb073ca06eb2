"""The lightning indexer of CSA layers (paper §2.3.1): which compressed entries each query attends to.

It owns a compressor at ``index_head_dim`` over the same windows as the attention's (its entries are the
indexer keys), scores ``sum_h w_h * ReLU(q_h . k)`` with queries from the attention's low-rank ``q_residual``
(compress RoPE at the query position), and keeps the top ``index_topk`` causal entries.
"""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.layout import RaggedLayout
from deepinfer.models.deepseek_v4.state import CompressorState
from deepinfer.ops import OpTable


class Indexer:
    def __init__(
        self,
        ops: OpTable,
        wq_b: torch.Tensor,
        weights_proj: torch.Tensor,
        compressor: Compressor,
        *,
        n_heads: int,
        head_dim: int,
        topk: int,
        inv_freq: torch.Tensor,
        rope_scaling: float,
    ):
        self.ops, self.wq_b, self.weights_proj, self.compressor = ops, wq_b, weights_proj, compressor
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling

    def __call__(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        layout: RaggedLayout,
        states: list[CompressorState],
    ) -> torch.Tensor:
        """Top-k entry ids [T, index_topk] per query (``-1`` where fewer entries are causal)."""
        keys = self.compressor(x, layout, states)
        longest = max(k.shape[0] for k in keys)
        if longest == 0:
            return torch.full((x.shape[0], self.topk), -1, dtype=torch.int64, device=x.device)
        padded = keys[0].new_zeros(len(keys), longest, self.head_dim)
        for i, k in enumerate(keys):
            padded[i, : k.shape[0]] = k
        q = self.ops.linear(q_residual, self.wq_b).view(x.shape[0], self.n_heads, self.head_dim)
        q = self.ops.rope(q, positions, self.inv_freq, self.rope_scaling)
        weights = self.ops.linear(x, self.weights_proj)
        limits = (positions + 1) // self.compressor.ratio  # entries pooling only tokens <= the query
        return self.ops.indexer_topk(
            q, weights, padded, layout.seq_ids, limits, self.topk, self.head_dim**-0.5, self.n_heads**-0.5
        )

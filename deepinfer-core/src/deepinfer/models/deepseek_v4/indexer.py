"""The lightning indexer of CSA layers (paper §2.3.1): which compressed entries each query attends to.

It owns a compressor at ``index_head_dim`` over the same windows as the attention's (its entries are the
indexer keys), scores ``sum_h w_h * ReLU(q_h . k)`` with queries from the attention's low-rank ``q_residual``
(compress RoPE at the query position), and keeps the top ``index_topk`` causal entries.
"""

from __future__ import annotations

import torch

from deepinfer.kv.decode_plan import CausalPicks, DecodePlan, DecodeStep
from deepinfer.kv.layout import RaggedLayout
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.state import DeepseekV4State, LayerCache
from deepinfer.ops import Ops


class Indexer:
    def __init__(
        self,
        ops: Ops,
        wq_b: torch.Tensor,
        compressor: Compressor,
        *,
        n_heads: int,
        head_dim: int,
        topk: int,
        inv_freq: torch.Tensor,
        rope_scaling: float,
    ):
        self.ops, self.wq_b, self.compressor = ops, wq_b, compressor
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling

    def _topk(self, weights: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              seq_ids: torch.Tensor, causal: CausalPicks | None = None) -> torch.Tensor:
        """The op's top-k, except that a query with at most ``index_topk`` causal entries takes them all in
        order, as when no sequence of the step has more (a row's picks never depend on its batch).
        ``causal``: those picks when the step's plan holds them (computed once for every layer)."""
        if causal is None:  # entries pooling only tokens <= the query
            causal = CausalPicks.build((positions + 1) // self.compressor.ratio,
                                       torch.arange(self.topk, device=positions.device))
        q = self.ops.linear(q_residual, self.wq_b).view(q_residual.shape[0], self.n_heads, self.head_dim)
        q = self.ops.rope(q, positions, self.inv_freq, self.rope_scaling)
        ids = self.ops.indexer_topk(
            q, weights, keys, seq_ids, causal.limits, self.topk, self.head_dim**-0.5, self.n_heads**-0.5
        )
        return torch.where(causal.takes_all, causal.ids, ids)

    def __call__(self, inputs, q_residual: torch.Tensor, positions: torch.Tensor, layout: RaggedLayout,
                 states: list[DeepseekV4State], cache: LayerCache) -> torch.Tensor | None:
        """Picked entry ids [T, index_topk] per query (``-1`` where fewer entries are causal); ``inputs``: the
        token's projections for the indexer's compressor and head weights.  None while no sequence has more
        than ``index_topk`` entries: then every causal entry is picked, without scoring (as HCA attends)."""
        assert cache.indexer is not None and cache.index_keys is not None  # a CSA layer's caches
        self.compressor(inputs.indexer_compressor, layout, states, cache.indexer, cache.index_keys, kv_rows=False)
        ratio = self.compressor.ratio
        longest = max((start + n) // ratio for start, n in zip(layout.starts, layout.lens, strict=True))
        if longest <= self.topk:
            return None
        # every sequence's keys through its page rows, one gather: past its own entries, keys its causal limit masks
        keys = cache.index_keys[layout.entry_rows[ratio][:, :longest]]  # [seqs, longest, index_head_dim]
        return self._topk(inputs.indexer_weights, q_residual, positions, keys, layout.seq_ids)

    def decode(self, inputs, q_residual: torch.Tensor, step: DecodeStep, plan: DecodePlan,
               cache: LayerCache) -> torch.Tensor | None:
        """:meth:`__call__` for one token per sequence, with fixed shapes: every sequence's keys are read
        through its whole page table (entries past its count are masked by the causal limit).  None while the
        length bucket holds no more entries than are picked."""
        ratio = plan.ratios[self.compressor.ratio]
        assert cache.indexer is not None and cache.index_keys is not None  # a CSA layer's caches
        self.compressor.decode(inputs.indexer_compressor, step.slots, ratio, cache.indexer, cache.index_keys)
        if ratio.picks is None:  # the plan's bucket holds no more entries than are picked
            return None
        keys = cache.index_keys[ratio.entry_rows]  # [B, pages * page, c]
        return self._topk(inputs.indexer_weights, q_residual, step.positions, keys, plan.seq_ids, ratio.picks)


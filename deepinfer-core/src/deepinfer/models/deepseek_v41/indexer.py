"""V4.1's indexer (CSA2): which of the group's compressed entries each query attends to.

A group's keys are made once, by its kv source: ``k_norm(wk(latent))`` of each pre-RoPE latent, rotated at the
entry's position, FP4 (ue8m0 scale per 32).  Every index source (Full, Reindex) scores them with its own queries
``wq_b(q_residual)`` (rotated at the query's position, FP4) and head weights: ``sum_h w_h * relu(q_h . k)``, and
keeps the top ``index_topk`` causal entries (``e < (p + 1) // ratio``); Reuse layers take the latest index
source's picks.  The candidate source also publishes blocks of entries with the best maximum score; index sources
after it pick only inside those blocks.  A query with at most ``index_topk`` causal entries takes them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.kv.decode_plan import CausalPicks
from deepinfer.kv.store import PagedRows, RowStore
from deepinfer.layers.linear import GetWeight, linear
from deepinfer.models.deepseek_v41.roles import FULL, LayerRole
from deepinfer.ops import Ops
from deepinfer.ops.fake_quant import ScaleFormat

#: The indexer keys' and queries' FP4 format (block, scale format).
KEY_FORMAT: tuple[int, ScaleFormat] = (32, "ue8m0")


@dataclass(slots=True)
class Published:
    """What index sources publish to the layers after them in one forward: each group's latest picks (None:
    every causal entry), and the candidate blocks."""

    picks: dict[int, torch.Tensor | None] = field(default_factory=dict)
    blocks: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class IndexerSpec:
    n_heads: int
    head_dim: int
    topk: int
    block_size: int  # candidate blocks
    topk_blocks: int
    eps: float


class Indexer:
    def __init__(self, ops: Ops, spec: IndexerSpec, role: LayerRole, get: Callable[[str], torch.Tensor],
                 prefix: str, inv_freq: torch.Tensor, rope_scaling: float, weight: GetWeight | None = None):
        self.ops, self.spec, self.role = ops, spec, role
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling
        self.wq_b = (weight or get)(prefix + "wq_b.weight")  # FP8 where the model keeps it quantized
        self.wk = self.k_norm = None
        if role.mode == FULL:  # the kv source also makes the group's keys
            self.wk, self.k_norm = get(prefix + "wk.weight"), get(prefix + "k_norm.weight")

    def _rope_fp4(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotated at ``positions``, then FP4: one op (a backend quantizes in the rotation's epilogue)."""
        return self.ops.rope_fp4_e2m1_fake_quant(x, positions, self.inv_freq, self.rope_scaling, *KEY_FORMAT)

    def keys(self, latents: torch.Tensor, positions: torch.Tensor, store: RowStore | None = None) -> torch.Tensor:
        """The group's indexer keys [n, head_dim] of pre-RoPE ``latents`` [n, dim] at their entries' positions, as
        ``store`` keeps them: packed (``store.packed``), or the FP4 fake-quantized values."""
        assert self.wk is not None
        k = self.ops.rms_norm(self.ops.linear(latents, self.wk), self.k_norm, self.spec.eps)
        if store is not None and store.packed:
            return store.stored(self.ops.rope(k, positions, self.inv_freq, self.rope_scaling))
        return self._rope_fp4(k, positions)

    def picks(self, q_residual: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
              keys: torch.Tensor | PagedRows, seq_ids: torch.Tensor, causal: CausalPicks, published: Published
              ) -> torch.Tensor:
        """Entry ids [T, topk] (``-1`` pads) of the queries' picks against ``keys`` [S, N, head_dim] (the group's
        keys of each sequence, padded: values, or their packed rows read in place by the ``_packed`` ops);
        publishes the candidate blocks if this is the candidate source."""
        ops, s = self.ops, self.spec
        q = linear(ops, q_residual, self.wq_b).view(q_residual.shape[0], s.n_heads, s.head_dim)
        q = self._rope_fp4(q, positions)
        rest = (seq_ids, causal.limits, s.topk, s.head_dim**-0.5, s.n_heads**-0.5)
        if isinstance(keys, PagedRows):
            fmt: ScaleFormat = "e4m3" if keys.fmt.scale_format == "e4m3" else "ue8m0"
            packed = (q, weights, keys.tensor, keys.rows, keys.fmt.block, fmt, *rest)
            if self.role.is_candidate_source:
                ids, published.blocks = ops.indexer_candidates_packed(*packed, s.block_size, s.topk_blocks)
            elif self.role.uses_candidates and published.blocks is not None:
                ids = ops.indexer_topk_in_blocks_packed(*packed, published.blocks, s.block_size)
            else:
                ids = ops.indexer_topk_packed(*packed)
            return torch.where(causal.takes_all, causal.ids, ids)
        args = (q, weights, keys, *rest)
        if self.role.is_candidate_source:
            ids, published.blocks = ops.indexer_candidates(*args, s.block_size, s.topk_blocks)
        elif self.role.uses_candidates and published.blocks is not None:
            ids = ops.indexer_topk_in_blocks(*args, published.blocks, s.block_size)
        else:
            ids = ops.indexer_topk(*args)
        return torch.where(causal.takes_all, causal.ids, ids)

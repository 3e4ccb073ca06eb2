"""The Engram module of a V4.1 layer (spec §9.5): look up the token's n-gram rows, project them to a key per
stream and one value, and add the value to each stream gated by how well the stream matches its key.

It runs at the start of its layer, before the attention site's mHC mixes: its output replaces the streams.
Hash ids come from :mod:`.engram_hash` (``ops.engram_hash`` on the look-back rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.layers.linear import GetWeight, Weight, linear
from deepinfer.models.deepseek_v41.engram_hash import EngramLayout
from deepinfer.quant import QuantizedTensor

#: Columns per ue8m0 scale of an FP8 table row.
TABLE_SCALE_BLOCK = 32


@dataclass(slots=True)
class EngramWeights:
    """``layers.N.engram.*`` of one layer."""

    table: torch.Tensor  # embed.weight [rows, head_dim]: float, or float8_e4m3fn with table_scale
    table_scale: torch.Tensor | None  # embed.scale [rows, head_dim / 32] e8m0 (uint8 or float8_e8m0fnu) or fp32
    wkv: Weight  # [(S + 1) * D, C * head_dim]: S keys (one per stream), then the value; FP8 as stored or dense
    q_weight: torch.Tensor  # [S, D] in the compute dtype
    k_weight: torch.Tensor  # [S, D]


#: ``gather(ops, weights, flat ids) -> (table rows as stored, their scale rows or None)``: rows held elsewhere.
Gather = Callable[[Any, EngramWeights, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def _table_scale(weights: EngramWeights) -> torch.Tensor:
    if weights.table_scale is None:
        raise ValueError("an FP8 Engram table needs its embed.scale tensor")
    return weights.table_scale


def local_rows(ops: Any, weights: EngramWeights, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of ``flat`` from the table held here as stored (an FP8 table's scale rows too), for a shard
    exchange to move.  FP8 rows and e8m0 scales are gathered as bytes: every device indexes uint8 rows (not every
    one has fp8 / e8m0 indexing kernels)."""
    if weights.table.dtype != torch.float8_e4m3fn:
        return ops.embedding(flat, weights.table), None
    scale = _table_scale(weights)  # e8m0 (float8_e8m0fnu or its bytes) gathers as bytes; fp32 scales as they are
    rows = ops.embedding(flat, weights.table.view(torch.uint8)).view(torch.float8_e4m3fn)
    return rows, ops.embedding(flat, scale.view(torch.uint8) if scale.element_size() == 1 else scale)


def engram_embed(ops: Any, weights: EngramWeights, hash_ids: torch.Tensor, gather: Gather | None = None
                 ) -> torch.Tensor:
    """[T, C * head_dim] in the compute dtype (``q_weight``'s): the table rows of ``hash_ids`` [T, C], concatenated.

    An FP8 table is dequantized with its per-32-column scales (``fp8 * scale`` in fp32); a float table's
    ``scale`` tensor is ignored, as the reference does.  ``gather``: None for the table held here, whose FP8
    rows are gathered and scaled in one op (``ops.embedding_fp8``); else where the stored rows come from (an
    expert-parallel rank's shard and the other ranks', :mod:`.engram_shard`), dequantized once
    they arrived (``ops.dequant_fp8_block``: the same values)."""
    flat, dtype = hash_ids.reshape(-1), weights.q_weight.dtype
    if gather is None and weights.table.dtype == torch.float8_e4m3fn:
        rows = ops.embedding_fp8(flat, weights.table, _table_scale(weights), TABLE_SCALE_BLOCK, dtype)
    else:
        rows, scales = (gather or local_rows)(ops, weights, flat)
        if scales is not None:
            rows = ops.dequant_fp8_block(rows, scales, 1, TABLE_SCALE_BLOCK, dtype)
    return rows.to(dtype).view(hash_ids.shape[0], -1)


def engram(ops: Any, weights: EngramWeights, streams: torch.Tensor, hash_ids: torch.Tensor, eps: float,
           gather: Gather | None = None) -> torch.Tensor:
    """The streams after the Engram module.

    streams: [T, S, D] (model dtype); hash_ids: [T, C] int64 table rows of this layer; eps: ``rms_norm_eps``.
    ``wkv`` of the looked-up rows gives S keys and one value per token; ``ops.engram_gate`` does the rest.
    Returns [T, S, D] in streams' dtype.
    """
    kv = linear(ops, engram_embed(ops, weights, hash_ids, gather), weights.wkv)
    tokens, n_streams, dim = streams.shape
    key = kv[:, : n_streams * dim].view(tokens, n_streams, dim)
    return ops.engram_gate(streams, key, kv[:, n_streams * dim :], weights.q_weight, weights.k_weight, eps)


class Engram:
    """One Engram layer of the model: its weights and hash layout; ``engram(streams, lookback)``."""

    def __init__(self, ops: Any, layout: EngramLayout, index: int, get: Callable[[str], torch.Tensor],
                 stored: Callable[[str], torch.Tensor | QuantizedTensor], eps: float, weight: GetWeight | None = None):
        """``weight``: ``wkv`` as the model keeps its projections (FP8 as stored); None: ``get``."""
        p = f"layers.{layout.layer_ids[index]}.engram."
        table = stored(p + "embed.weight")  # an FP8 table stays FP8: rows are dequantized as they are gathered
        rows, scale = (table.data, table.scale) if isinstance(table, QuantizedTensor) else (table, None)
        wkv = (weight or get)(p + "wkv.weight")
        self.weights = EngramWeights(rows, scale, wkv, get(p + "q_weight"), get(p + "k_weight"))
        self.ops, self.eps = ops, eps
        self.hash = layout.hash_tensors(index, self.weights.q_weight.device)
        #: Where table rows come from: this table (None) or a shard exchange (expert parallelism).
        self.gather: Gather | None = None
        self.idle: Callable[[], None] = lambda: None  # join a step with no tokens (a shard exchange does)

    def __call__(self, streams: torch.Tensor, lookback: torch.Tensor) -> torch.Tensor:
        """New streams [T, S, D] from ``streams`` and the tokens' look-back compressed ids [T, N]."""
        rows = self.ops.engram_hash(lookback, *self.hash)
        return engram(self.ops, self.weights, streams, rows, self.eps, self.gather)

"""The Engram block (V4.1 layers ``engram_layer_ids``): a hashed n-gram memory gated into the residual streams.

Each token's n-grams of compressed ids (sizes 2..N, ``n_heads`` hashes each) select rows of the layer's table;
the rows are projected by ``wkv`` to one key per stream and a shared value, and each stream takes the value
through a gate of how well it matches its key (``ops.engram_gate``).  It runs at the start of its layer, before
the attention site's mHC mixing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.deepseek_v41.engram_hash import EngramLayout
from deepinfer.ops import OpTable
from deepinfer.quant import QuantizedTensor


class Engram:
    def __init__(self, ops: OpTable, layout: EngramLayout, index: int, get: Callable[[str], torch.Tensor],
                 stored: Callable[[str], torch.Tensor | QuantizedTensor], eps: float):
        p = f"layers.{layout.layer_ids[index]}.engram."
        self.ops, self.eps = ops, eps
        self.table = stored(p + "embed.weight")  # may stay FP8: rows are dequantized as they are gathered
        self.wkv, self.q_weight, self.k_weight = get(p + "wkv.weight"), get(p + "q_weight"), get(p + "k_weight")
        device = self.wkv.device
        self.multipliers, self.primes, self.offsets = layout.hash_tensors(index, device)

    def rows(self, lookback: torch.Tensor) -> torch.Tensor:
        """Table rows [T, C] of each token's n-grams; ``lookback`` [T, N] compressed ids."""
        return self.ops.engram_hash(lookback, self.multipliers, self.primes, self.offsets)

    def __call__(self, streams: torch.Tensor, lookback: torch.Tensor) -> torch.Tensor:
        """New streams [T, S, D] from ``streams`` and the tokens' look-back compressed ids [T, N]."""
        rows = self.rows(lookback)
        if isinstance(self.table, QuantizedTensor):
            embedded = self.table.gather_rows(self.ops, rows, streams.dtype)
        else:
            embedded = self.ops.embedding(rows.flatten(), self.table).view(*rows.shape, -1)
        kv = self.ops.linear(embedded.flatten(1).to(self.wkv.dtype), self.wkv)
        tokens, n_streams, dim = streams.shape
        key, value = kv[:, : n_streams * dim].view(tokens, n_streams, dim), kv[:, n_streams * dim :]
        return self.ops.engram_gate(streams, key, value, self.q_weight, self.k_weight, self.eps)

"""V4 attention (paper §2.3): shared K=V multi-query attention over a sliding window plus compressed entries.

- queries: low-rank ``q = wq_b(RMSNorm(wq_a x))``, a per-head unweighted RMSNorm, RoPE on the last rope dims;
- one K=V latent per token: ``RMSNorm(wkv x)`` with RoPE;
- keys = the last ``sliding_window`` latents (every layer) and, in CSA / HCA layers, compressed entries:
  HCA attends to every causal entry, CSA to the lightning indexer's top-k;
- a learned sink logit per head joins the softmax; the output's rope dims are rotated back (inverse RoPE),
  then the grouped output projection: ``o_groups`` blocks to ``o_lora_rank`` each, then ``wo_b``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.indexer import Indexer
from deepinfer.models.deepseek_v4.layout import RaggedLayout
from deepinfer.models.deepseek_v4.rope import inv_freq
from deepinfer.models.deepseek_v4.state import LayerState
from deepinfer.ops import OpTable


class Attention:
    def __init__(self, ops: OpTable, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor]):
        p = f"layers.{layer}.attn."
        self.ops, self.kind, self.ratio = ops, cfg.layer_types[layer], cfg.compress_ratios[layer]
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        spec = cfg.rope_main if self.kind == SLIDING else cfg.rope_compress
        device = get(p + "wkv.weight").device
        self.inv_freq, self.rope_scaling = inv_freq(spec, cfg.rope_head_dim).to(device), spec.attention_scaling
        self.wq_a, self.q_norm, self.wq_b = get(p + "wq_a.weight"), get(p + "q_norm.weight"), get(p + "wq_b.weight")
        self.wkv, self.kv_norm = get(p + "wkv.weight"), get(p + "norm.weight")
        self.wo_a, self.wo_b, self.sinks = get(p + "wo_a.weight"), get(p + "wo_b.weight"), get(p + "attn_sink")
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            self.compressor = self._compressor(get, p + "compressor.", cfg)
        if self.kind == CSA:
            self.indexer = Indexer(
                ops,
                get(p + "indexer.wq_b.weight"),
                get(p + "indexer.weights_proj.weight"),
                self._compressor(get, p + "indexer.compressor.", cfg),
                n_heads=cfg.index_n_heads,
                head_dim=cfg.index_head_dim,
                topk=cfg.index_topk,
                inv_freq=self.inv_freq,
                rope_scaling=self.rope_scaling,
            )

    def _compressor(self, get: Callable[[str], torch.Tensor], p: str, cfg: DeepseekV4Config) -> Compressor:
        return Compressor(
            self.ops,
            get(p + "wkv.weight"),
            get(p + "wgate.weight"),
            get(p + "ape"),
            get(p + "norm.weight"),
            ratio=self.ratio,
            overlap=self.kind == CSA,
            eps=cfg.rms_norm_eps,
            inv_freq=self.inv_freq,
            rope_scaling=self.rope_scaling,
        )

    def new_state(self, dtype: torch.dtype, device: torch.device) -> LayerState:
        return LayerState(
            torch.empty(0, self.head_dim, dtype=dtype, device=device),
            self.window,
            None if self.compressor is None else self.compressor.new_state(dtype, device),
            None if self.indexer is None else self.indexer.compressor.new_state(dtype, device),
        )

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, layout: RaggedLayout, states: list[LayerState]
    ) -> torch.Tensor:
        ops, tokens = self.ops, x.shape[0]
        q_residual = ops.rms_norm(ops.linear(x, self.wq_a), self.q_norm, self.eps)
        q = ops.linear(q_residual, self.wq_b).view(tokens, self.heads, self.head_dim)
        q = ops.rope(ops.rms_norm(q, None, self.eps), positions, self.inv_freq, self.rope_scaling)
        kv = ops.rms_norm(ops.linear(x, self.wkv), self.kv_norm, self.eps)
        kv = ops.rope(kv, positions, self.inv_freq, self.rope_scaling)

        entries = picks = None
        if self.compressor is not None:
            entries = self.compressor(x, layout, [s.compressor for s in states])
        if self.indexer is not None:
            picks = self.indexer(x, q_residual, positions, layout, [s.indexer for s in states])
        if all(n == 1 for n in layout.lens):
            pool, indices = self._decode_plan(kv, positions, layout, states, entries, picks)
        else:
            pool, indices = self._gather_plan(kv, positions, layout, states, entries, picks)

        out = ops.sparse_attention(q, pool, indices, self.sinks, self.head_dim**-0.5)
        out = ops.rope(out, positions, self.inv_freq, self.rope_scaling, inverse=True)
        out = ops.grouped_linear(out.view(tokens, self.groups, -1), self.wo_a).flatten(1)
        return ops.linear(out, self.wo_b)

    def _gather_plan(
        self,
        kv: torch.Tensor,
        positions: torch.Tensor,
        layout: RaggedLayout,
        states: list[LayerState],
        entries: list[torch.Tensor] | None,
        picks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV pool (per sequence: window history, new latents, compressed entries) and each query's rows
        of it; advances the SWA rings."""
        pool: list[torch.Tensor] = []
        rows_per_seq: list[torch.Tensor] = []
        offset = 0
        window = torch.arange(1 - self.window, 1, device=kv.device)
        for i, state in enumerate(states):
            rows, start = layout.rows(i), layout.starts[i]
            history = state.swa_history(start)
            pos = positions[rows]
            key_pos = pos[:, None] + window[None, :]  # [L, window]: the window ending at each query
            first_pos = start - history.shape[0]  # position of pool row `offset`
            cols = [torch.where(key_pos >= 0, offset + key_pos - first_pos, -1)]
            parts = [history, kv[rows]]
            if entries is not None:
                base = offset + history.shape[0] + kv[rows].shape[0]
                if picks is not None:
                    ids = picks[rows]
                else:  # HCA: every entry whose window is complete at the query
                    ids = torch.arange(entries[i].shape[0], device=kv.device).expand(pos.shape[0], -1)
                    ids = torch.where(ids < ((pos + 1) // self.ratio)[:, None], ids, -1)
                cols.append(torch.where(ids >= 0, base + ids, -1))
                parts.append(entries[i])
            pool += parts
            offset += sum(p.shape[0] for p in parts)
            rows_per_seq.append(torch.cat(cols, dim=1))
            state.swa_append(kv[rows], start)
        width = max(r.shape[1] for r in rows_per_seq)
        padded = [torch.nn.functional.pad(r, (0, width - r.shape[1]), value=-1) for r in rows_per_seq]
        return torch.cat(pool), torch.cat(padded)

    def _decode_plan(
        self,
        kv: torch.Tensor,
        positions: torch.Tensor,
        layout: RaggedLayout,
        states: list[LayerState],
        entries: list[torch.Tensor] | None,
        picks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_gather_plan` for a batch of one new token per sequence (decode), in a fixed number of kernels
        instead of ~20 per sequence: each SWA ring first takes its token (it then holds exactly the window
        ending at the query), the pool is every ring then every sequence's entries, and each query's rows are
        the same keys in the same order as :meth:`_gather_plan` gives."""
        window, batch, device = self.window, len(states), kv.device
        rings = []
        for state in states:
            if state.swa_ring.shape[0] == 0:
                state.swa_ring = kv.new_zeros(window, kv.shape[-1])
            rings.append(state.swa_ring)
        # One multi-tensor copy for the whole batch (slots are host-side ints: position mod window).
        torch._foreach_copy_([ring[start % window] for ring, start in zip(rings, layout.starts)], list(kv.unbind(0)))
        key_pos = positions[:, None] + torch.arange(1 - window, 1, device=device)[None, :]  # [B, window], ascending
        ring_rows = torch.arange(batch, device=device)[:, None] * window + key_pos % window
        cols = [torch.where(key_pos >= 0, ring_rows, -1)]
        if entries is None:
            return torch.cat(rings), cols[0]
        # Entries so far = windows closed by this token, (position + 1) // ratio: computed on the device, so no
        # host list is copied (a blocking copy would stall the host until the queued work finishes).
        count = (positions + 1) // self.ratio
        base = batch * window + torch.cumsum(count, 0) - count
        if picks is not None:  # CSA: the indexer's top-k
            ids = picks
        else:  # HCA: every entry whose window is complete at the query
            ids = torch.arange(max(e.shape[0] for e in entries), device=device).expand(batch, -1)
            ids = torch.where(ids < count[:, None], ids, -1)
        cols.append(torch.where(ids >= 0, base[:, None] + ids, -1))
        return torch.cat(rings + list(entries)), torch.cat(cols, dim=1)

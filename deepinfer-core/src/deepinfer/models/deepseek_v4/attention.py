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
from typing import NamedTuple

import torch

from deepinfer.kv.decode_plan import DecodePlan, DecodeStep
from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.pool import StatePool
from deepinfer.layers.linear import GetWeight, Projection, grouped_linear, linear
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.indexer import Indexer
from deepinfer.models.deepseek_v4.state import DeepseekV4State, LayerCache
from deepinfer.models.rope import inv_freq
from deepinfer.ops import Ops


class Attention:
    def __init__(self, ops: Ops, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor],
                 weight: GetWeight | None = None):
        """``weight``: the projections' weights as the model keeps them (FP8 where quantized); default ``get``."""
        weight = weight or get
        p = f"layers.{layer}.attn."
        self.ops, self.layer, self.kind, self.ratio = ops, layer, cfg.layer_types[layer], cfg.compress_ratios[layer]
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        spec = cfg.rope_main if self.kind == SLIDING else cfg.rope_compress
        device = get(p + "norm.weight").device
        self.inv_freq, self.rope_scaling = inv_freq(spec, cfg.rope_head_dim).to(device), spec.attention_scaling
        self.q_norm, self.kv_norm = get(p + "q_norm.weight"), get(p + "norm.weight")
        self.wq_b = weight(p + "wq_b.weight")
        self.wo_a, self.wo_b, self.sinks = weight(p + "wo_a.weight"), weight(p + "wo_b.weight"), get(p + "attn_sink")
        # Everything the layer projects the token itself to, as one GEMM: wq_a | wkv | compressor kv | gate |
        # indexer compressor kv | gate | indexer head weights (one read of x and one launch instead of up to 7).
        blocks = [["wq_a"], ["wkv"]]
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            self.compressor = self._compressor(get, p + "compressor.", cfg)
            blocks.append(["compressor.wkv", "compressor.wgate"])
        if self.kind == CSA:
            self.indexer = Indexer(
                ops,
                get(p + "indexer.wq_b.weight"),
                self._compressor(get, p + "indexer.compressor.", cfg),
                n_heads=cfg.index_n_heads,
                head_dim=cfg.index_head_dim,
                topk=cfg.index_topk,
                inv_freq=self.inv_freq,
                rope_scaling=self.rope_scaling,
            )
            blocks += [["indexer.compressor.wkv", "indexer.compressor.wgate"], ["indexer.weights_proj"]]
        parts = [[weight(p + name + ".weight") for name in block] for block in blocks]
        self.w_in = Projection([w for block in parts for w in block])
        self.in_splits = [sum(w.shape[0] for w in block) for block in parts]

    def _compressor(self, get: Callable[[str], torch.Tensor], p: str, cfg: DeepseekV4Config) -> Compressor:
        return Compressor(
            self.ops,
            get(p + "ape"),
            get(p + "norm.weight"),
            ratio=self.ratio,
            overlap=self.kind == CSA,
            eps=cfg.rms_norm_eps,
            inv_freq=self.inv_freq,
            rope_scaling=self.rope_scaling,
        )

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """The token's projections: ``q_residual`` (the indexer reads it), per-head queries and the K=V
        latent (both rotated), and what the compressors and the indexer read (``inputs``)."""
        ops, tokens = self.ops, x.shape[0]
        q_lin, kv_lin, *rest = self.w_in(ops, x).split(self.in_splits, dim=1)
        q_residual = ops.rms_norm(q_lin, self.q_norm, self.eps)
        q = linear(ops, q_residual, self.wq_b).view(tokens, self.heads, self.head_dim)
        q = ops.rms_norm_rope(q, None, self.eps, positions, self.inv_freq, self.rope_scaling)
        kv = ops.rms_norm_rope(kv_lin, self.kv_norm, self.eps, positions, self.inv_freq, self.rope_scaling)
        return q_residual, q, kv, _Inputs(*rest)

    def _output(self, q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor, positions: torch.Tensor):
        ops, tokens = self.ops, q.shape[0]
        out = ops.sparse_attention_inverse_rope(q, pool, indices, self.sinks, self.head_dim**-0.5, positions,
                                                self.inv_freq, self.rope_scaling)
        out = grouped_linear(ops, out.view(tokens, self.groups, -1), self.wo_a).flatten(1)
        return linear(ops, out, self.wo_b)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, layout: RaggedLayout,
                 states: list[DeepseekV4State], pool: StatePool, cache: LayerCache) -> torch.Tensor:
        """Any chunk lengths: the step's attention pool is the sequences' window history and entries gathered
        from the layer's kv tensor, then the new latents (``layout.plans``: where, shared by every layer of this
        ratio); then each SWA ring takes its newest latents."""
        q_residual, q, kv, inputs = self._project(x, positions)
        plan = layout.plans[self.ratio]
        cols, picks = plan.window_cols, None
        if self.compressor is not None:  # first: the step's closed windows are entries the pool gathers
            # a compressed layer has its projections, its cache and its ratio's entry columns
            assert inputs.compressor is not None and cache.compressor is not None
            assert plan.entry_offsets is not None and plan.causal_cols is not None
            self.compressor(inputs.compressor, layout, states, cache.compressor, cache.kv, kv_rows=True)
            if self.indexer is not None:  # CSA: the indexer's picks (None: every causal entry, as HCA)
                picks = self.indexer(inputs, q_residual, positions, layout, states, cache)
            if picks is not None:
                cols = torch.cat([cols, torch.where(picks >= 0, plan.entry_offsets[:, None] + picks, -1)], dim=1)
            else:  # HCA: the window and every entry whose window is complete at the query
                cols = plan.causal_cols
        keys = torch.cat([cache.kv[plan.gather_rows], kv])
        cache.kv.index_copy_(0, plan.ring_rows, kv[plan.ring_src])  # after the gather: it read the old rings
        if (rows := layout.query_rows) is not None:  # context parallelism: this rank's queries only
            q, cols, positions = q[rows], cols[rows], positions[rows]
        return self._output(q, keys, cols, positions)

    def decode(self, x: torch.Tensor, step: DecodeStep, plan: DecodePlan, pool: StatePool,
               cache: LayerCache) -> torch.Tensor:
        """One token per sequence with fixed shapes and no host data (CUDA-graph safe): the token's latent
        goes to its ring first (which then holds exactly the window ending at it), and attention reads rings
        and entry pages in place through row indices (``plan``: computed once per step for every layer)."""
        q_residual, q, kv, inputs = self._project(x, step.positions)
        cache.kv.index_copy_(0, plan.ring_rows, kv)
        cols = plan.window_cols
        if self.compressor is not None:
            ratio = plan.ratios[self.ratio]
            assert inputs.compressor is not None and cache.compressor is not None  # a compressed layer's
            self.compressor.decode(inputs.compressor, step.slots, ratio, cache.compressor,
                                   cache.kv[pool.entry_base(self.ratio) :])
            ids = None
            if self.indexer is not None:  # CSA: the indexer's top-k (None: every causal entry, as HCA)
                ids = self.indexer.decode(inputs, q_residual, step, plan, cache)
            if ids is not None:  # the picks' KV pool rows (-1 where none: the last column of pick_cols)
                assert ratio.pick_cols is not None  # the plan holds them whenever the indexer picks
                cols = torch.cat([cols, ratio.pick_cols[plan.seq_ids[:, None], ids]], dim=1)
            else:  # HCA: the window and every entry whose window is complete at the query
                assert ratio.causal_cols is not None  # the plan holds them whenever no indexer picks
                cols = ratio.causal_cols
        return self._output(q, cache.kv, cols, step.positions)


class _Inputs(NamedTuple):
    """Projections of the token for the compressors and the indexer (views into one GEMM's output)."""

    compressor: torch.Tensor | None = None  # [T, 2 * width]: kv | gate
    indexer_compressor: torch.Tensor | None = None  # [T, 2 * index width]
    indexer_weights: torch.Tensor | None = None  # [T, index heads]

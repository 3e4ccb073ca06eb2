"""DeepSeek-V4 as a causal LM over the op table.

    streams = [embed(tokens)] * hc_mult                        # mHC residual: hc_mult streams per token
    for each layer:
        x, post, comb = hc_pre(streams)                        # collapse the streams into one input
        streams = hc_post(attention(RMSNorm(x)), streams, post, comb)
        x, post, comb = hc_pre(streams)
        streams = hc_post(moe(RMSNorm(x)), streams, post, comb)
    hidden = RMSNorm(hc_head(streams));  logits = head(hidden)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.kv.decode_plan import DecodePlan, DecodeStep, RatioKinds
from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.pool import PooledState, StatePool
from deepinfer.layers.ep_moe import build_moe
from deepinfer.layers.linear import GetWeight, dense_getter, stored_weight
from deepinfer.layers.mhc import HcSpec, HyperConnection
from deepinfer.layers.moe import MoESpec
from deepinfer.models.base import ForwardBatch
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import CSA, HASH_MOE, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.state import layer_caches, spec_for
from deepinfer.models.deepseek_v4.weights import V4Weights
from deepinfer.models.pooled import PooledCausalLM
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.context_parallel import context_split, run_split


class DecoderLayer:
    def __init__(self, ops: Ops, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor],
                 parallel: ParallelContext | None = None, weight: GetWeight | None = None):
        p = f"layers.{layer}."
        self.ops, self.eps = ops, cfg.rms_norm_eps
        hc = HcSpec(cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        self.attn_hc = HyperConnection(ops, hc, get, p + "hc_attn")
        self.ffn_hc = HyperConnection(ops, hc, get, p + "hc_ffn")
        self.attn_norm, self.ffn_norm = get(p + "attn_norm.weight"), get(p + "ffn_norm.weight")
        self.attn = Attention(ops, cfg, layer, get, weight)
        moe = MoESpec(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func,
                      cfg.swiglu_limit, hash_routed=cfg.mlp_layer_types[layer] == HASH_MOE)
        self.ffn = build_moe(ops, moe, p + "ffn.", get, parallel, layer, weight)

    def __call__(self, streams: torch.Tensor, input_ids: torch.Tensor,
                 attend: Callable[[Attention, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``attend(attention, x)`` runs this layer's attention on ``x`` against the step's state."""
        ops = self.ops
        x, post, comb = self.attn_hc.pre(streams)
        out = attend(self.attn, ops.rms_norm(x, self.attn_norm, self.eps))
        streams = ops.hc_post(out, streams, post, comb)
        x, post, comb = self.ffn_hc.pre(streams)
        out = self.ffn(ops.rms_norm(x, self.ffn_norm, self.eps), input_ids)
        return ops.hc_post(out, streams, post, comb)


class DeepseekV4ForCausalLM(PooledCausalLM):
    """Implements :class:`deepinfer.models.base.CausalLM`.

    Quantized checkpoint tensors are dequantized (through the op table) into the compute dtype (no stored copy is
    kept), except, with ``native_weights``, FP8 projections and MXFP4 / FP8 routed experts (kept as stored, run by
    the quantized GEMM ops); the MTP layer's tensors are kept in :attr:`mtp_weights`.
    ``parallel``: this rank's parallel context (expert-parallel MoE layers); None: one process.
    """

    def __init__(
        self, cfg: DeepseekV4Config, weights: V4Weights, *, ops: Ops, dtype: torch.dtype, device: torch.device,
        parallel: ParallelContext | None = None, native_weights: bool = False,
    ):
        self.config, self.ops, self.dtype, self.device = cfg, ops, dtype, torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.mtp_weights = weights.mtp
        get = dense_getter(weights.tensors, ops, dtype)
        self.embed = get("embed.weight")
        self.head = self.embed if cfg.tie_word_embeddings else get("head.weight")
        self.norm = get("norm.weight")
        self.hc_head = (get("hc_head_fn"), get("hc_head_base"), get("hc_head_scale"))
        weight = stored_weight(weights.tensors, get) if native_weights else None
        self.layers = [DecoderLayer(ops, cfg, i, get, parallel, weight) for i in range(cfg.num_hidden_layers)]
        self.parallel = parallel
        self.state_spec, self.views = spec_for(cfg), layer_caches
        self.ratio_kinds = {r: RatioKinds(overlap=CSA in kinds, indexed=CSA in kinds, attends_all=HCA in kinds)
                            for r, kinds in _kinds_by_ratio(cfg).items()}

    def _ragged(self, batch: ForwardBatch, layout: RaggedLayout, states: list[PooledState], pool: StatePool
                ) -> torch.Tensor:
        def attend(attn, x):
            return attn(x, batch.positions, layout, states, pool, pool.views[attn.layer])

        if (split := context_split(self.parallel, batch.seq_lens, self.device)) is not None:  # this rank's rows
            return run_split(self._run, split, layout, batch.input_ids, attend)
        return self._run(batch.input_ids, attend)

    def _decode(self, step: DecodeStep, pool: StatePool) -> torch.Tensor:
        spec = pool.spec
        plan = DecodePlan.build(step, spec.window, spec.page_size, {r: pool.entry_base(r) for r in pool.ratios},
                                self.config.index_topk, self.ratio_kinds, spec.ring)
        return self._run(step.input_ids, lambda attn, x: attn.decode(x, step, plan, pool, pool.views[attn.layer]))

    def _run(self, input_ids: torch.Tensor, attend: Callable[[Attention, torch.Tensor], torch.Tensor]):
        cfg, ops = self.config, self.ops
        x = ops.embedding(input_ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, attend)
        hidden = ops.hc_head(streams, *self.hc_head, cfg.rms_norm_eps, cfg.hc_eps)
        return ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps)



def _kinds_by_ratio(cfg: DeepseekV4Config) -> dict[int, set[str]]:
    """The layer kinds of each compression ratio."""
    out: dict[int, set[str]] = {}
    for kind, ratio in zip(cfg.layer_types, cfg.compress_ratios, strict=True):
        if kind != SLIDING:
            out.setdefault(ratio, set()).add(kind)
    return out

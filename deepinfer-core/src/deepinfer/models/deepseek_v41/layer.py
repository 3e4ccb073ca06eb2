"""One DeepSeek-V4.1 block, the body of :mod:`.model`'s layer loop: Engram (Engram layers only), then the mHC
sites around attention and the MoE.  The backbone stacks them as ``layers.N.*``; the DSpark drafter
(:mod:`.dspark`) builds its draft layers from the same class (``mtp.i.*``, a sliding-only role, its own MoE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.layers.ep_moe import build_moe
from deepinfer.layers.linear import GetWeight
from deepinfer.layers.mhc import HcSpec, HyperConnection
from deepinfer.layers.moe import MoESpec
from deepinfer.models.deepseek_v41.attention import Attention
from deepinfer.models.deepseek_v41.config import DeepseekV41Config, LayerRole
from deepinfer.models.deepseek_v41.engram import Engram
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext

#: attend(attention, x, layer index) -> the attention sublayer's output
Attend = Callable[[Attention, torch.Tensor, int], torch.Tensor]


def moe_spec(cfg: DeepseekV41Config, experts: int, top_k: int) -> MoESpec:
    """The MoE of a backbone layer (``n_routed_experts`` / ``num_experts_per_tok``) or of a DSpark draft layer
    (``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok``): the rest is shared."""
    limit = cfg.swiglu_limit if cfg.swiglu_limit > 0 else None
    return MoESpec(experts, top_k, cfg.routed_scaling_factor, cfg.scoring_func, limit, gate_temp=cfg.gate_temp)


class DecoderLayer:
    """One block: mHC sites, attention, MoE.  Backbone layer N reads ``layers.N.*``; the DSpark drafter builds
    its draft layers from the same class with ``prefix="mtp.i."``, a sliding-only role and its own MoE spec.
    ``weight``: the projections' and experts' weights as the model keeps them (FP8 / MXFP4); None: ``get``."""

    def __init__(self, ops: Ops, cfg: DeepseekV41Config, role: LayerRole, get: Callable[[str], torch.Tensor],
                 engram: Engram | None, *, prefix: str | None = None, moe: MoESpec | None = None,
                 parallel: ParallelContext | None = None, weight: GetWeight | None = None):
        p = prefix if prefix is not None else f"layers.{role.layer_id}."
        self.ops, self.eps, self.engram = ops, cfg.rms_norm_eps, engram
        hc = HcSpec(cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        self.attn_hc = HyperConnection(ops, hc, get, p + "hc_attn")
        self.ffn_hc = HyperConnection(ops, hc, get, p + "hc_ffn")
        self.attn_norm, self.ffn_norm = get(p + "attn_norm.weight"), get(p + "ffn_norm.weight")
        self.attn = Attention(ops, cfg, role, get, prefix=p + "attn.", weight=weight)
        moe = moe if moe is not None else moe_spec(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok)
        self.ffn = build_moe(ops, moe, p + "ffn.", get, parallel, role.layer_id, weight)

    def __call__(self, streams: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor,
                 lookback: torch.Tensor | None, attend: Attend, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams, the FFN site's pre) after this layer; ``pre``: the previous site's."""
        site = self.attention_input(streams, pre, lookback)
        return self.finish(site, input_ids, attend, index)

    def attention_input(self, streams: torch.Tensor, pre: torch.Tensor, lookback: torch.Tensor | None) -> Site:
        """Engram, then the attention site's mixing: (streams, normalised input, pre, post, comb)."""
        if self.engram is not None:
            assert lookback is not None
            streams = self.engram(streams, lookback)
        x, pre, post, comb = self.attn_hc.pre_single_pass(streams, pre)
        return Site(streams, self.ops.rms_norm(x, self.attn_norm, self.eps), pre, post, comb)

    def finish(self, site: Site, input_ids: torch.Tensor, attend: Attend, index: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention on the site's input, then the FFN site: (streams, the FFN site's pre)."""
        ops = self.ops
        streams = ops.hc_post(attend(self.attn, site.x, index), site.streams, site.post, site.comb)
        x, pre, post, comb = self.ffn_hc.pre_single_pass(streams, site.pre)
        out = self.ffn(ops.rms_norm(x, self.ffn_norm, self.eps), input_ids)
        return ops.hc_post(out, streams, post, comb), pre


@dataclass(slots=True)
class Site:
    """An attention site's residual streams and mixing, and the sublayer input it collapsed [T, D]."""

    streams: torch.Tensor
    x: torch.Tensor
    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor

    def rows(self, rows: torch.Tensor) -> Site:
        return Site(self.streams[rows], self.x[rows], self.pre[rows], self.post[rows], self.comb[rows])


def build_layers(tensors: dict[str, Any], prefix: str, num_layers: int,
                 build: Callable[[int], DecoderLayer]) -> list[DecoderLayer]:
    """``build(N)`` for N < ``num_layers``, dropping layer N's entries of ``tensors`` (``prefix + N + "."``) once
    it is built: it keeps what it runs (its stacks in place of the stored parts), so a load holds two copies of one
    layer at most."""
    names: list[list[str]] = [[] for _ in range(num_layers)]
    for name in tensors:
        if name.startswith(prefix):
            digits = name[len(prefix) :].split(".", 1)[0]
            if digits.isdigit() and int(digits) < num_layers:
                names[int(digits)].append(name)
    layers = []
    for index, built in enumerate(names):
        layers.append(build(index))
        for name in built:
            del tensors[name]
    return layers

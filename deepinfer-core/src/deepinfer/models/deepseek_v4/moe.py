"""V4 MoE (paper §2.1): routed experts plus one shared expert, in every layer.

The first layers route by a frozen token-id table (``tid2eid``, hash MoE); the others by
``sqrt(softplus(logits))`` with a correction bias for selection only.  Experts are SwiGLU with the gate
clamped above and the up projection clamped both ways at ``swiglu_limit``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config
from deepinfer.ops import OpTable


class MoE:
    def __init__(self, ops: OpTable, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor]):
        p = f"layers.{layer}.ffn."
        self.ops, self.cfg = ops, cfg
        self.is_hash = cfg.mlp_layer_types[layer] == HASH_MOE
        self.gate = get(p + "gate.weight")
        self.tid2eid = get(p + "gate.tid2eid") if self.is_hash else None
        self.bias = None if self.is_hash else get(p + "gate.bias")
        experts = range(cfg.n_routed_experts)
        self.w13 = torch.stack([self._w13(get, f"{p}experts.{e}.") for e in experts])  # [E, 2I, H]
        self.w2 = torch.stack([get(f"{p}experts.{e}.w2.weight") for e in experts])  # [E, H, I]
        self.shared_w13, self.shared_w2 = self._w13(get, p + "shared_experts."), get(p + "shared_experts.w2.weight")

    @staticmethod
    def _w13(get: Callable[[str], torch.Tensor], p: str) -> torch.Tensor:
        return torch.cat([get(p + "w1.weight"), get(p + "w3.weight")])

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        if self.is_hash:
            ids = self.tid2eid[input_ids]
            weights = ops.moe_hash_router(x, self.gate, ids, cfg.routed_scaling_factor, cfg.scoring_func)
        else:
            weights, ids = ops.moe_router(
                x, self.gate, self.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func
            )
        routed = ops.moe_experts(x, ids, weights, self.w13, self.w2, cfg.swiglu_limit)
        return routed + ops.swiglu_mlp(x, self.shared_w13, self.shared_w2, cfg.swiglu_limit)

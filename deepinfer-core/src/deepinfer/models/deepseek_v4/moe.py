"""V4 MoE (paper §2.1): routed experts plus one shared expert, in every layer.

The first layers route by a frozen token-id table (``tid2eid``, hash MoE); the others by
``sqrt(softplus(logits))`` with a correction bias for selection only.  Experts are SwiGLU with the gate
clamped above and the up projection clamped both ways at ``swiglu_limit``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config
from deepinfer.ops import Ops


class MoE:
    def __init__(self, ops: Ops, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor]):
        p = f"layers.{layer}.ffn."
        self.ops, self.cfg = ops, cfg
        self.is_hash = cfg.mlp_layer_types[layer] == HASH_MOE
        self.gate = get(p + "gate.weight")
        self.tid2eid = get(p + "gate.tid2eid") if self.is_hash else None
        self.bias = None if self.is_hash else get(p + "gate.bias")
        experts = [f"{p}experts.{e}." for e in range(cfg.n_routed_experts)]
        shared = p + "shared_experts."
        w13 = [self._w13(get, e) for e in experts]
        w2 = [get(e + "w2.weight") for e in experts]
        shared_w13, shared_w2 = self._w13(get, shared), get(shared + "w2.weight")
        #: The shared expert has the routed experts' shape in V4, so it runs as one more expert (id E, weight 1)
        #: of the same grouped GEMMs: same arithmetic and order (added after the routed experts, as
        #: ``routed + shared`` would), without a separate MLP's launches.
        self.shared_id = len(experts) if shared_w13.shape == w13[0].shape and shared_w2.shape == w2[0].shape else None
        if self.shared_id is not None:
            w13.append(shared_w13)
            w2.append(shared_w2)
            # the shared expert's id and weight for every token: one column each, broadcast by cat
            self.shared_slot = (torch.full((1, 1), self.shared_id, dtype=torch.int64, device=shared_w2.device),
                                torch.ones((1, 1), dtype=torch.float32, device=shared_w2.device))
        self.w13 = torch.stack(w13)  # [E (+1), 2I, H]
        self.w2 = torch.stack(w2)  # [E (+1), H, I]
        #: (w13, w2) of a shared expert shaped unlike the routed ones, run as its own MLP; None: it is one of them
        self.shared = None if self.shared_id is not None else (shared_w13, shared_w2)

    @staticmethod
    def _w13(get: Callable[[str], torch.Tensor], p: str) -> torch.Tensor:
        return torch.cat([get(p + "w1.weight"), get(p + "w3.weight")])

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        if self.tid2eid is not None:  # hash routing
            ids = self.tid2eid[input_ids]
            weights = ops.moe_hash_router(x, self.gate, ids, cfg.routed_scaling_factor, cfg.scoring_func)
        else:
            weights, ids = ops.moe_router(
                x, self.gate, self.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func
            )
        if self.shared is not None:
            routed = ops.moe_experts(x, ids, weights, self.w13, self.w2, cfg.swiglu_limit)
            return routed + ops.swiglu_mlp(x, *self.shared, cfg.swiglu_limit)
        shared_id, shared_weight = self.shared_slot
        ids = torch.cat([ids, shared_id.expand(ids.shape[0], 1)], dim=1)
        weights = torch.cat([weights, shared_weight.expand(weights.shape[0], 1)], dim=1)
        return ops.moe_experts(x, ids, weights, self.w13, self.w2, cfg.swiglu_limit)

"""Mixture of experts (V4 paper §2.1): routed experts plus one shared expert.

Hash layers (V4's first layers) route by a frozen token-id table (``tid2eid``); the others by
``score_func(logits / gate_temp)`` with a correction bias for selection only (V4.1 divides the logits by its
``gate_temp``; V4 has none).  Experts are SwiGLU with the gate clamped above and the up projection clamped both
ways at ``swiglu_limit``.  Routed experts kept in their released form (``DEEPINFER_QUANTIZED_WEIGHTS=native``)
stay as stored and run through ``moe_experts_mxfp4`` (MXFP4) or ``moe_experts_fp8`` (FP8 e4m3 with block scales);
the shared expert (FP8 as released) then runs as its own MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.layers.linear import GetWeight, Weight, stack_rows, swiglu_mlp
from deepinfer.ops import Ops
from deepinfer.quant import FP8_BLOCK, MXFP4, QuantizedTensor


@dataclass(slots=True, frozen=True)
class MoESpec:
    """The MoE hyperparameters of one layer (plain data from the model config)."""

    n_routed_experts: int
    top_k: int
    routed_scaling_factor: float
    score_func: str
    swiglu_limit: float | None
    hash_routed: bool = False  # route by the frozen ``gate.tid2eid`` table
    gate_temp: float = 1.0  # router logits are divided by it


class MoE:
    """``experts``: the routed experts this instance holds, stacked in that order (expert parallelism holds a
    rank's share); None: all of them.  ``weight``: the experts' weights as the model keeps them (MXFP4 / FP8 where
    quantized); None: ``get``."""

    def __init__(self, ops: Ops, spec: MoESpec, prefix: str, get: Callable[[str], torch.Tensor],
                 experts: Sequence[int] | None = None, weight: GetWeight | None = None):
        p = prefix
        self.ops, self.spec = ops, spec
        gate = get(p + "gate.weight")
        # logits / gate_temp == x @ (W / gate_temp)^T: the temperature folded into the router weight (in fp32)
        self.gate = gate if spec.gate_temp == 1.0 else (gate.float() / spec.gate_temp).to(gate.dtype)
        self.tid2eid = get(p + "gate.tid2eid") if spec.hash_routed else None
        self.bias = None if spec.hash_routed else get(p + "gate.bias")
        held = [f"{p}experts.{e}." for e in (range(spec.n_routed_experts) if experts is None else experts)]
        shared = p + "shared_experts."
        #: (w13 scales, w2 scales) when the routed experts stay as stored (w13 / w2 then hold the stored data)
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None
        #: the scale block of routed experts kept FP8; None: kept MXFP4 (or not kept)
        self.fp8_block: tuple[int, int] | None = None
        #: (w13, w2) of a shared expert run as its own MLP; None: it is expert E of the grouped GEMMs
        self.shared: tuple[Weight, Weight] | None = None
        if weight is not None and self._keep_stored(weight, held, shared, get):
            return
        w13 = [self._w13(get, e) for e in held]
        w2 = [get(e + "w2.weight") for e in held]
        shared_w13, shared_w2 = self._w13(get, shared), get(shared + "w2.weight")
        #: The shared expert has the routed experts' shape in V4, so it runs as one more expert (id E, weight 1)
        #: of the same grouped GEMMs: same arithmetic and order (added after the routed experts, as
        #: ``routed + shared`` would), without a separate MLP's launches.
        self.shared_id = len(held) if shared_w13.shape == w13[0].shape and shared_w2.shape == w2[0].shape else None
        if self.shared_id is not None:
            w13.append(shared_w13)
            w2.append(shared_w2)
            # the shared expert's id and weight for every token: one column each, broadcast by cat
            self.shared_slot = (torch.full((1, 1), self.shared_id, dtype=torch.int64, device=shared_w2.device),
                                torch.ones((1, 1), dtype=torch.float32, device=shared_w2.device))
        self.w13 = torch.stack(w13)  # [E (+1), 2I, H]
        self.w2 = torch.stack(w2)  # [E (+1), H, I]
        if self.shared_id is None:  # shaped unlike the routed experts
            self.shared = (shared_w13, shared_w2)

    def _keep_stored(self, weight: GetWeight, experts: list[str], shared: str,
                     get: Callable[[str], torch.Tensor]) -> bool:
        """Keep the routed experts as stored if :func:`kept_format` says they can stay so (w1 and w3 of each
        expert stacked into w13, data and scales alike); the shared expert keeps its FP8 form when w1 and w3 stack
        into one weight (else it is dequantized)."""
        stored = [weight(e + w) for e in experts for w in ("w1.weight", "w3.weight", "w2.weight")]
        q = [w for w in stored if isinstance(w, QuantizedTensor)]
        fmt = kept_format(stored)
        if fmt is None:
            return False
        n = len(experts)
        self.w13 = torch.stack([torch.cat([q[3 * e].data, q[3 * e + 1].data]) for e in range(n)])
        self.w2 = torch.stack([q[3 * e + 2].data for e in range(n)])
        self.scales = (torch.stack([torch.cat([q[3 * e].scale, q[3 * e + 1].scale]) for e in range(n)]),
                       torch.stack([q[3 * e + 2].scale for e in range(n)]))
        self.fp8_block = q[0].block if fmt == FP8_BLOCK else None
        self.shared_id = None
        w13 = stack_rows([weight(shared + "w1.weight"), weight(shared + "w3.weight")])
        self.shared = ((w13[0], weight(shared + "w2.weight")) if len(w13) == 1
                       else (self._w13(get, shared), get(shared + "w2.weight")))
        return True

    @staticmethod
    def _w13(get: Callable[[str], torch.Tensor], p: str) -> torch.Tensor:
        return torch.cat([get(p + "w1.weight"), get(p + "w3.weight")])

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, logical expert ids [T, k] int64) of every token."""
        ops, spec = self.ops, self.spec
        if self.tid2eid is not None:
            ids = self.tid2eid[input_ids]
            return ops.moe_hash_router(x, self.gate, ids, spec.routed_scaling_factor, spec.score_func), ids
        return ops.moe_router(x, self.gate, self.bias, spec.top_k, spec.routed_scaling_factor, spec.score_func)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert ids[t, j](x[t])`` over the experts held here (``ids`` index the stacks),
        through the grouped GEMM op of the form they are kept in: dense, MXFP4 or FP8 (:attr:`scales` set)."""
        limit = self.spec.swiglu_limit
        if self.scales is None:
            return self.ops.moe_experts(x, ids, weights, self.w13, self.w2, limit)
        s13, s2 = self.scales
        if self.fp8_block is not None:
            return self.ops.moe_experts_fp8(x, ids, weights, self.w13, s13, self.w2, s2, *self.fp8_block, limit)
        return self.ops.moe_experts_mxfp4(x, ids, weights, self.w13, s13, self.w2, s2, limit)

    def idle(self) -> None:
        """Join a step with no tokens: nothing to do without expert parallelism."""

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ops, spec = self.ops, self.spec
        weights, ids = self.route(x, input_ids)
        if self.shared is not None:
            return self.experts(x, ids, weights) + swiglu_mlp(ops, x, *self.shared, spec.swiglu_limit)
        shared_id, shared_weight = self.shared_slot
        ids = torch.cat([ids, shared_id.expand(ids.shape[0], 1)], dim=1)
        weights = torch.cat([weights, shared_weight.expand(weights.shape[0], 1)], dim=1)
        return ops.moe_experts(x, ids, weights, self.w13, self.w2, spec.swiglu_limit)


def kept_format(stored: Sequence[Weight]) -> str | None:
    """The format routed experts' weights (each expert's w1, w3, w2) can stay in: MXFP4 when all are MXFP4; FP8
    when all are FP8 with one scale block and scale dtype and w1's rows fill whole row blocks (so w1's and w3's
    scale rows stack into w13's, as the data does); None (dequantize) otherwise, mixed formats included."""
    q = [w for w in stored if isinstance(w, QuantizedTensor)]
    if not q or len(q) < len(stored):
        return None
    if all(w.format == MXFP4 for w in q):
        return MXFP4
    if (all(w.format == FP8_BLOCK for w in q) and len({(w.block, w.scale.dtype) for w in q}) == 1
            and q[0].shape[0] % q[0].block[0] == 0):
        return FP8_BLOCK
    return None


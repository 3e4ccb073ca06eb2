"""The DSpark drafter's weights as the model holds them: its draft layers, context combiner and heads, built once
from the checkpoint's ``mtp.*`` tensors when the model loads (:mod:`.dspark_weights` names them).

The model keeps these, not the tensors: the layers stack what they run together (``wq_a | wkv``, each expert's
``w1 | w3``) and the stacks are all that is held, as the target's layers do, so the drafter takes the bytes the
memory plan gives it (the stored formats with ``native`` weights, the compute dtype with ``dequantize``).
Every :class:`~.dspark.DSparkDrafter` of the model shares them; a drafter adds only its per-slot context.
"""

from __future__ import annotations

import torch

from deepinfer.layers.linear import dense_getter, stored_weight
from deepinfer.models.deepseek_v41.config import DeepseekV41Config, LayerRole
from deepinfer.models.deepseek_v41.dspark_heads import ConfidenceHead, MarkovHead
from deepinfer.models.deepseek_v41.dspark_weights import check_mtp, layer_prefix
from deepinfer.models.deepseek_v41.layer import DecoderLayer, build_layers, moe_spec
from deepinfer.models.deepseek_v41.roles import SWA
from deepinfer.ops import Ops
from deepinfer.quant import QuantizedTensor

Stored = torch.Tensor | QuantizedTensor


def draft_role(layer_id: int) -> LayerRole:
    """A draft layer's role: sliding window only (its ``compress_ratios`` entry is 0)."""
    return LayerRole(layer_id, 0, SWA, None, None, False, False, False)


class DSparkLayers:
    """``layers`` (``mtp.i.*``: V4.1 blocks, sliding-only, their own MoE), ``main_proj`` / ``main_norm`` (the
    context combiner of ``mtp.0``), the final ``norm`` and the Markov and confidence heads (of the last stage).
    FP8 projections and MXFP4 / FP8 experts stay as loaded (the target's weight mode)."""

    def __init__(self, cfg: DeepseekV41Config, tensors: dict[str, Stored], *, ops: Ops, dtype: torch.dtype):
        """``tensors``: the ``mtp.*`` tensors, consumed as the model's are (a draft layer's dropped once built)."""
        n = cfg.num_nextn_predict_layers
        if n == 0:
            raise ValueError("num_nextn_predict_layers is 0: this checkpoint has no DSpark drafter")
        check_mtp(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, "checkpoint")
        get = dense_getter(tensors, ops, dtype)
        weight = stored_weight(tensors, get)
        moe = moe_spec(cfg, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        first, last = layer_prefix(0), layer_prefix(n - 1)
        self.main_proj, self.main_norm = weight(first + "main_proj.weight"), get(first + "main_norm.weight")
        self.norm = get(last + "norm.weight")
        self.markov, self.confidence = MarkovHead(ops, get, last), ConfidenceHead(ops, get, last)
        self.layers = build_layers(tensors, "mtp.", n, lambda i: DecoderLayer(
            ops, cfg, draft_role(cfg.num_hidden_layers + i), get, None, prefix=layer_prefix(i), moe=moe,
            weight=weight))

"""What the memory plan (:mod:`deepinfer.engine.memory_plan`) needs to know of V4.1 beyond its tensors' names:
which weights the model holds in fp32, the state a sequence holds, the DSpark drafter's per-slot context, and
an estimate of one step's activations.  Pure functions of the config."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.kv.spec import StateSpec
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.roles import FULL
from deepinfer.models.deepseek_v41.state import state_spec
from deepinfer.models.deepseek_v41.weights import MTP_FP32
from deepinfer.models.weight_reader import keeps_fp32


def held_in_fp32(cfg: DeepseekV41Config) -> Callable[[str], bool]:
    """``held(name)``: whether the model holds float tensor ``name`` in fp32 whatever its compute dtype: the
    norms, mHC, sinks and router biases (as the reference does), DSpark's confidence head, and the compressors of
    ratio > 1, whose ``wkv | wgate`` run as one fp32 GEMM."""
    fp32_compressors = tuple(f"layers.{r.layer_id}.attn.compressor.w" for r in cfg.layers
                             if r.mode == FULL and r.ratio > 1)
    confidence = (*MTP_FP32, "confidence_head.weight")  # (both spellings of the release)

    def held(name: str) -> bool:
        return keeps_fp32(name) or name.endswith(confidence) or name.startswith(fp32_compressors)

    return held


def sequence_state(cfg: DeepseekV41Config, quantized_kv: bool) -> StateSpec:
    """The buffers of one sequence's state (``DEEPINFER_QUANTIZED_KV``: rows in the model's formats)."""
    return state_spec(cfg, quantized=quantized_kv)


def drafter_context_bytes(cfg: DeepseekV41Config, slots: int, element_size: int) -> int:
    """The DSpark drafter's per-slot context rings (``dspark_context.ContextRings``) for ``slots`` state slots."""
    if not cfg.num_nextn_predict_layers:
        return 0
    rows = cfg.sliding_window + cfg.dspark_block_size + 1
    per_row = cfg.num_nextn_predict_layers * cfg.head_dim * element_size + 8  # latents, and the position (int64)
    return slots * rows * per_row


def activation_bytes(cfg: DeepseekV41Config, tokens: int, element_size: int) -> int:
    """An estimate of the largest activations one layer of a ``tokens``-row step holds at once: the mHC streams
    (in, out, mixing), the queries and attention output, the low-rank projections, the indexer's queries and the
    routed + shared experts' intermediates, in the compute dtype; the router's logits in fp32."""
    d, streams = cfg.hidden_size, cfg.hc_mult
    width = (3 * streams * d + 2 * cfg.num_attention_heads * cfg.head_dim
             + cfg.q_lora_rank + cfg.head_dim + cfg.index_n_heads * (1 + cfg.index_head_dim)
             + cfg.o_groups * cfg.o_lora_rank + 3 * (cfg.num_experts_per_tok + 1) * cfg.moe_intermediate_size)
    return tokens * (width * element_size + cfg.n_routed_experts * 4)

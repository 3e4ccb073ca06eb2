"""DeepSeek-V4 (``model_type: deepseek_v4``)."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.models.checkpoint import SafetensorsCheckpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.state import DeepseekV4State
from deepinfer.models.deepseek_v4.weights import read_weights
from deepinfer.models.weights_mode import weights_mode
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext

__all__ = ["DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4State", "load"]


def load(path: str | Path, *, ops: Ops, dtype: torch.dtype, device: torch.device,
         parallel: ParallelContext | None = None, drafter: bool = True) -> DeepseekV4ForCausalLM:
    """Build the model from a checkpoint directory (config.json + safetensors); ``parallel``: this rank's
    parallel context (None: one process).  Quantized weights stay as stored or become ``dtype`` by
    :func:`~deepinfer.models.weights_mode.weights_mode`.  ``drafter``: read the MTP layer's tensors."""
    cfg = DeepseekV4Config.from_file(path)
    mode = weights_mode(ops)
    weights = read_weights(SafetensorsCheckpoint(path), cfg, dtype, torch.device(device),
                           keep=parallel.loads if parallel is not None else None,
                           dequantize=None if mode.native else ops, drafter=drafter)
    if cfg.quant is not None:
        mode.log(path)
    return DeepseekV4ForCausalLM(cfg, weights, ops=ops, dtype=dtype, device=device, parallel=parallel,
                                 native_weights=mode.native)

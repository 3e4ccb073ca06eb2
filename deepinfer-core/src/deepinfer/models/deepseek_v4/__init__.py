"""DeepSeek-V4 (``model_type: deepseek_v4``)."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.models.checkpoint import SafetensorsCheckpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.state import DeepseekV4State
from deepinfer.models.deepseek_v4.weights import read_weights
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext

__all__ = ["DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4State", "load"]


def load(path: str | Path, *, ops: Ops, dtype: torch.dtype, device: torch.device,
         parallel: ParallelContext | None = None) -> DeepseekV4ForCausalLM:
    """Build the model from a checkpoint directory (config.json + safetensors); ``parallel``: this rank's
    parallel context (None: one process); ``DEEPINFER_QUANTIZED_WEIGHTS=native`` keeps FP8 / MXFP4 weights as
    stored."""
    cfg = DeepseekV4Config.from_file(path)
    weights = read_weights(SafetensorsCheckpoint(path), cfg, dtype, torch.device(device),
                           keep=parallel.loads if parallel is not None else None)
    return DeepseekV4ForCausalLM(cfg, weights, ops=ops, dtype=dtype, device=device, parallel=parallel,
                                 native_weights=envs.quantized_weights() == "native")

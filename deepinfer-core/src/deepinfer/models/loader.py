"""Public entry points: read a checkpoint's config, or build its model on a backend's op table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.models.base import CausalLM
from deepinfer.models.registry import entry_for
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext


def read_model_config(path: str | Path) -> Any:
    """The model's config dataclass (``DeepseekV4Config`` for ``deepseek_v4``), from ``path/config.json``."""
    return entry_for(path).read_config(path)


def load_model(path: str | Path, *, ops: OpTable, dtype: torch.dtype, device: torch.device,
               parallel: ParallelContext | None = None, drafter: bool = True) -> CausalLM:
    """Build the model in ``path`` (config.json + safetensors) for ``ops``' backend, computing in ``dtype``;
    ``parallel``: this rank's parallel context (``docs/parallel.md``), None for one process; ``drafter``: read the
    checkpoint's speculative drafter (False where speculative decoding will not run: its tensors are only
    checked)."""
    extra: dict[str, Any] = {} if parallel is None else {"parallel": parallel}
    if not drafter:
        extra["drafter"] = False
    return entry_for(path).load(path, ops=ops, dtype=dtype, device=torch.device(device), **extra)

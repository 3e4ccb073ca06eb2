"""Public entry points: read a checkpoint's config, or build its model on a backend's op table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.backends.backend import Backend
from deepinfer.models.base import CausalLM
from deepinfer.models.registry import entry_for
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext


def read_model_config(path: str | Path) -> Any:
    """The model's config dataclass (``DeepseekV4Config`` for ``deepseek_v4``), from ``path/config.json``."""
    return entry_for(path).read_config(path)


def load_model(path: str | Path, *, ops: OpTable, dtype: torch.dtype, device: torch.device,
               parallel: ParallelContext | None = None, drafter: bool = True, engram_placement: str = "host",
               backend: Backend | None = None) -> CausalLM:
    """Build the model in ``path`` (config.json + safetensors) for ``ops``' backend, computing in ``dtype``;
    ``parallel``: this rank's parallel context (``docs/parallel.md``), None for one process; ``drafter``: read the
    checkpoint's speculative drafter (False where speculative decoding will not run: its tensors are only
    checked).  ``engram_placement``: where V4.1's Engram tables live, ``"host"`` memory the device reads in place
    (``backend.host_resident``; None: the base class's, which copies to a device other than the host) or
    ``"device"`` (models without Engram tables ignore both)."""
    entry = entry_for(path)
    options: dict[str, Any] = {"parallel": parallel} if parallel is not None else {}
    if not drafter:
        options["drafter"] = False
    if entry.engram:
        options.update(engram_placement=engram_placement, backend=backend)
    return entry.load(path, ops=ops, dtype=dtype, device=torch.device(device), **options)

"""DeepInfer core: a hardware-agnostic inference engine for DeepSeek V4-family models.

``from deepinfer import LLM, SamplingParams``.  Importing the package is cheap: the engine (and torch)
load on first use of these names, and no backend is selected until an ``LLM`` is built.  It gives the
``deepinfer`` logger its default handler (:mod:`deepinfer.logger`) and, unless the user chose, asks OpenMP
for passive waiting (:mod:`deepinfer.host_threads`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deepinfer.host_threads import prefer_passive_waiting
from deepinfer.logger import configure_logging

__version__ = "0.1.0"

_LAZY = {
    "LLM": "deepinfer.engine.llm",
    "EngineArgs": "deepinfer.engine.args",
    "SamplingParams": "deepinfer.sampling_params",
    "RequestOutputKind": "deepinfer.sampling_params",
    "StructuredOutputsParams": "deepinfer.structured.vllm_names",
    "RequestMetrics": "deepinfer.outputs",
    "RequestOutput": "deepinfer.outputs",
    "CompletionOutput": "deepinfer.outputs",
    "Logprob": "deepinfer.outputs",
}

__all__ = ["__version__", *_LAZY]

configure_logging()
prefer_passive_waiting()  # before anything loads torch (and OpenMP with it): deepinfer.host_threads

if TYPE_CHECKING:
    from deepinfer.engine.args import EngineArgs as EngineArgs
    from deepinfer.engine.llm import LLM as LLM
    from deepinfer.outputs import CompletionOutput as CompletionOutput
    from deepinfer.outputs import Logprob as Logprob
    from deepinfer.outputs import RequestMetrics as RequestMetrics
    from deepinfer.outputs import RequestOutput as RequestOutput
    from deepinfer.sampling_params import RequestOutputKind as RequestOutputKind
    from deepinfer.sampling_params import SamplingParams as SamplingParams
    from deepinfer.structured.vllm_names import StructuredOutputsParams as StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

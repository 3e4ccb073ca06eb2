"""The ``example`` backend: CPU tensors, with its own ``rms_norm``."""

from __future__ import annotations

from collections import Counter

import torch

from deepinfer.backends import Backend, hookimpl
from deepinfer.backends.cpu import CpuBackend

#: How often each override ran; lets tests prove the backend's code, not core's, was called.
CALLS: Counter[str] = Counter()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as ``deepinfer.ops.norm.rms_norm``, computed by torch's fused functional."""
    CALLS["rms_norm"] += 1
    w = None if weight is None else weight.float()
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


class ExampleBackend(CpuBackend):
    """Reuses the CPU device services; only the name and one op differ."""

    name = "example"
    auto_priority = None  # never picked implicitly: only DEEPINFER_ACCELERATOR=example selects it

    def load_ops(self):
        return {"rms_norm": rms_norm}


@hookimpl
def deepinfer_backend() -> Backend:
    return ExampleBackend()

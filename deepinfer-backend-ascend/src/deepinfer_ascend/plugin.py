"""Entry point ``ascend`` of the ``deepinfer.backends`` group."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from deepinfer.backends import Backend, hookimpl


def _npu() -> Any:
    """``torch.npu``, which importing torch_npu adds to torch."""
    return torch.npu  # type: ignore[attr-defined]  # added by torch_npu at import: torch's stubs lack it


class AscendBackend(Backend):
    """Ascend 950 NPUs through torch_npu.  Uses core's reference ops until kernels land."""

    name = "ascend"
    device_type = "npu"
    auto_priority = 90
    dist_backend = "hccl"

    def unavailable_reason(self) -> str | None:
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:
            return (f"torch_npu is not importable ({type(exc).__name__}: {exc}); "
                    "install it with `pip install deepinfer-backend-ascend[npu]` on a machine with CANN")
        if not _npu().is_available():
            return "torch_npu is installed but no NPU device is visible"
        return None

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return _npu().mem_get_info(device)

    def synchronize(self, device: torch.device) -> None:
        _npu().synchronize(device)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        _npu().manual_seed_all(seed)


@hookimpl
def deepinfer_backend() -> Backend:
    return AscendBackend()

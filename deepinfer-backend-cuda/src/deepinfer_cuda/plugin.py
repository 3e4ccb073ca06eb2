"""Entry point ``nvidia`` of the ``deepinfer.backends`` group."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from deepinfer.backends import Backend, hookimpl
from deepinfer_cuda.arch import SUPPORTED_CAPABILITIES  # SM90 = Hopper, SM100 = Blackwell


class CudaBackend(Backend):
    """NVIDIA GPUs through torch's CUDA runtime, with Triton / TileLang kernels."""

    name = "nvidia"
    device_type = "cuda"
    auto_priority = 100
    dist_backend = "nccl"
    @property
    def batch_invariant_ops(self) -> tuple[str, ...]:
        """The ops each kernel module declares batch-invariant (``@override(..., batch_invariant=...)``)."""
        from deepinfer_cuda.ops import batch_invariant_ops

        return batch_invariant_ops()

    def unavailable_reason(self) -> str | None:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        cap = torch.cuda.get_device_capability(0)
        if cap not in SUPPORTED_CAPABILITIES:
            return f"GPU 0 has compute capability {cap}; this kernel set supports {SUPPORTED_CAPABILITIES}"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install deepinfer-backend-cuda installs it)"
        return None

    def load_ops(self) -> Mapping[str, Callable[..., Any]]:
        from deepinfer import envs
        from deepinfer_cuda.ops import kernels_by_op

        return kernels_by_op(batch_invariant=envs.batch_invariant())

    def op_coverage(self) -> Mapping[str, Callable[..., bool]]:
        from deepinfer_cuda.ops import coverage

        return coverage()

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def to_host_async(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A non-blocking copy into pinned memory and an event recorded after it: waiting on the event waits
        for this copy (and what was queued before it), not for later steps."""
        if t.device.type != "cuda":
            return super().to_host_async(t)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> torch.Tensor:
            done.synchronize()
            return host

        return wait

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def host_resident(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` pinned where it is and read by the GPU in place through UVA (:mod:`deepinfer_cuda.host_memory`):
        no copy in device memory; kernels and captured graphs read its bits over PCIe / C2C."""
        if device.type != "cuda":
            return super().host_resident(t, device)
        from deepinfer_cuda.host_memory import mapped_view

        return mapped_view(t, device)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Staged through pinned memory and copied with ``non_blocking=True``: a pageable source makes the copy
        synchronous.  ``pin_memory()`` copies a pageable ``t`` into a block of torch's caching host allocator, which
        records the copy's stream and is not reused before the copy has run; an already pinned ``t`` is copied from
        in place, so the caller must not mutate it until the stream has passed the copy."""
        if t.device.type == "cuda":
            return t.to(device)
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)

    @contextlib.contextmanager
    def graph_capture(self, device: torch.device) -> Iterator[Callable[[Callable[[], Any]], Callable[[], Any]]]:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)

        def capture(fn: Callable[[], Any]) -> Callable[[], Any]:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                fn()  # warm-up outside the graph: lazy init, autotuning
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                fn()
            return graph.replay

        yield capture

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)


@hookimpl
def deepinfer_backend() -> Backend:
    return CudaBackend()

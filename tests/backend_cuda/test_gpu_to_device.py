"""On the GPU: ``CudaBackend.to_device`` copies a step's host tensors without blocking the host.

Skipped on CPU-only machines (CI); run on the GPU host with ``pytest tests/backend_cuda -q``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_cuda.plugin import CudaBackend

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")


@requires_cuda
@pytest.mark.cuda
def test_to_device_is_exact_and_does_not_synchronize():
    backend, device = CudaBackend(), torch.device("cuda", 0)
    host = [torch.randint(-(1 << 40), 1 << 40, (n,)) for n in (1, 17, 4096)]
    torch.cuda.synchronize()
    slow = torch.empty(4096, 4096, device=device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        slow.normal_()  # keep the stream busy: a blocking copy would have to wait for this
        copies = [backend.to_device(t, device) for t in host]
        pinned = backend.to_device(host[2].pin_memory(), device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for t, c in zip(host, copies, strict=True):
        assert c.device == device and c.dtype == t.dtype and torch.equal(c.cpu(), t)
    assert torch.equal(pinned.cpu(), host[2])


@requires_cuda
@pytest.mark.cuda
def test_staging_buffer_is_not_reused_before_the_copy_ran():
    # Many copies queued behind slow work, each from a pageable tensor that is dropped at once: torch's caching
    # host allocator must keep every pinned staging block until its copy has run.
    backend, device = CudaBackend(), torch.device("cuda", 0)
    busy = torch.randn(8192, 8192, device=device)
    outs = []
    for i in range(64):
        busy = busy @ busy.T / 8192 if i % 16 == 0 else busy
        outs.append(backend.to_device(torch.full((1000,), i, dtype=torch.int64), device))
    torch.cuda.synchronize()
    assert all(bool((o == i).all()) for i, o in enumerate(outs))

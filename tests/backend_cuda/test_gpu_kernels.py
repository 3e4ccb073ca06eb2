"""On the GPU: every overridden op against core's reference, and the AOT cubin path against Triton JIT.

Skipped on CPU-only machines (CI); run on the GPU host with ``pytest tests/backend_cuda -q``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.testing import check_op, conformance_params
from deepinfer_cuda.plugin import CudaBackend

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host: pytest tests/backend_cuda")
BACKEND = CudaBackend()


def _conformance_cases():
    try:
        return conformance_params(BACKEND)  # (op, dtype) for every op the backend overrides
    except ImportError as exc:  # triton missing: nothing to check, say so
        return [pytest.param("?", None, marks=pytest.mark.skip(reason=f"cannot load the CUDA ops: {exc}"))]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op_name, dtype", _conformance_cases())
def test_conformance(op_name, dtype):
    assert check_op(BACKEND, op_name, dtype) > 0


@pytest.fixture(scope="module")
def device_kernel_set(tmp_path_factory):
    """A kernel set for this GPU's arch, built by this process's Triton (as build.sh does)."""
    from deepinfer_cuda.kernel_set.build import build_kernel_set
    from deepinfer_cuda.kernel_set.dispatch import device_arch

    arch = device_arch(torch.cuda.current_device())
    out = tmp_path_factory.mktemp("device_kernel_set")
    build_kernel_set(out, [arch])
    return out


def _rms_inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, dim in [(1, 4096), (37, 4096), (256, 512), (3, 16384), (5, 20480), (100, 128), (7, 1280)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, dim, device="cuda", dtype=dtype, generator=gen)
            w = 1 + 0.1 * torch.randn(dim, device="cuda", dtype=dtype, generator=gen)
            yield x, w
            yield x, None


@requires_cuda
@pytest.mark.cuda
def test_aot_cubin_equals_jit_bitwise(device_kernel_set):
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set
    from deepinfer_cuda.kernels.rms_norm import KERNEL, rms_norm

    cases = list(_rms_inputs())
    try:
        ks = use_kernel_set(device_kernel_set)
        assert ks.refusal is None, ks.refusal
        aot = [rms_norm(x, w, 1e-6) for x, w in cases]
        assert KERNEL.launch_counts == {"cubin": len(cases), "jit": 0}
        use_kernel_set(None)
        jit = [rms_norm(x, w, 1e-6) for x, w in cases]
        assert KERNEL.launch_counts == {"cubin": 0, "jit": len(cases)}
    finally:
        use_kernel_set(device_kernel_set)
    for (x, w), a, j in zip(cases, aot, jit):
        assert torch.equal(a, j), f"AOT and JIT differ for {tuple(x.shape)} {x.dtype} weight={w is not None}"


@requires_cuda
@pytest.mark.cuda
def test_unmatched_specialization_falls_back_to_jit_and_is_right(device_kernel_set):
    from deepinfer.ops.norm import rms_norm as reference
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set
    from deepinfer_cuda.kernels.rms_norm import KERNEL, rms_norm

    use_kernel_set(device_kernel_set)
    base = torch.randn(4 * 4096 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(4, 4096)  # 2-byte offset: no aligned cubin applies
    y = rms_norm(x, None, 1e-6)
    assert KERNEL.launch_counts == {"cubin": 0, "jit": 1}
    torch.testing.assert_close(y.float().cpu(), reference(x.cpu(), None, 1e-6).float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.cuda
def test_cubin_launch_is_captured_by_cuda_graphs(device_kernel_set):
    # The cubin launcher must enqueue on torch's current stream, so graph capture records it.
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set
    from deepinfer_cuda.kernels.rms_norm import KERNEL, rms_norm

    use_kernel_set(device_kernel_set)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    with BACKEND.graph_capture(BACKEND.device()) as capture:
        replay = capture(lambda: out.copy_(rms_norm(x, w, 1e-6)))
    assert KERNEL.launch_counts["cubin"] >= 2 and KERNEL.launch_counts["jit"] == 0
    x.copy_(torch.randn_like(x))
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), atol=0, rtol=0)


def test_gpu_tests_skip_with_a_reason_on_cpu():
    # Guard against the GPU tests silently passing on CPU: without CUDA they must be marked skipped.
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    assert requires_cuda.args[0] is True and "GPU" in requires_cuda.kwargs["reason"]

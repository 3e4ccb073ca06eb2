"""On the GPU: the MoE expert kernel at V4-Flash shapes (conformance covers the small samples).

- as accurate as core's reference: both against an fp32 computation from the same bf16 inputs;
- no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``), so it can sit inside a CUDA graph,
  and a captured call replays to the eager result;
- the AOT cubins (decode and prefill tiles) give the JIT's bits.
Skipped on CPU-only machines (CI); run on the GPU host with ``pytest tests/backend_cuda -q``.
"""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host: pytest tests/backend_cuda")
pytestmark = [requires_cuda, pytest.mark.cuda]

HIDDEN, INTER, EXPERTS, TOP_K, LIMIT = 4096, 2048, 64, 6, 10.0


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5).bfloat16()
    return w13, w2


def _routing(tokens: int, seed: int, repeat: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (2 * torch.randn(tokens, HIDDEN, device="cuda", generator=gen)).bfloat16()
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).argsort(dim=1)[:, :TOP_K]
    if repeat:  # a token may list an expert twice: it counts twice
        ids[:, 1] = ids[:, 0]
    w = torch.rand(tokens, TOP_K, device="cuda", generator=gen)
    return x, ids, w


def _fp32_truth(x, ids, w, w13, w2):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(EXPERTS):
        rows, slots = torch.where(ids == e)
        if rows.numel():
            g, u = (x[rows].float() @ w13[e].float().T).chunk(2, dim=-1)
            h = torch.nn.functional.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT)
            out.index_add_(0, rows, (h @ w2[e].float().T) * w[rows, slots, None])
    return out


@pytest.mark.parametrize("tokens, repeat",
                         [(1, False), (8, True), (16, False), (64, True), (300, False), (1024, False)])
def test_as_accurate_as_the_reference_without_host_syncs(weights, tokens, repeat):
    from deepinfer.ops.moe import moe_experts as reference
    from deepinfer_cuda.kernels.moe_experts import moe_experts

    w13, w2 = weights
    x, ids, w = _routing(tokens, seed=tokens, repeat=repeat)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = moe_experts(x, ids, w, w13, w2, LIMIT)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference(x, ids, w, w13, w2, LIMIT)
    truth = _fp32_truth(x, ids, w, w13, w2)
    err = lambda y: ((y.float() - truth).norm() / truth.norm()).item()  # noqa: E731
    assert ours.shape == x.shape and ours.dtype == torch.bfloat16
    assert err(ours) <= 1.25 * err(ref) + 1e-4, f"kernel error {err(ours):.3g}, reference {err(ref):.3g}"
    assert err(ours) < 1e-2


@pytest.mark.parametrize("tokens", [1, 16, 200])  # narrow decode tiles, decode tiles, the chunked plan (> 1024 slots)
def test_graph_capture_replays_to_the_eager_result(weights, tokens):
    from deepinfer_cuda.kernels.moe_experts import moe_experts
    from deepinfer_cuda.plugin import CudaBackend

    w13, w2 = weights
    x, ids, w = _routing(tokens, seed=7)
    out = torch.empty_like(x)
    backend = CudaBackend()
    with backend.graph_capture(backend.device()) as capture:
        replay = capture(lambda: out.copy_(moe_experts(x, ids, w, w13, w2, LIMIT)))
    x2, ids2, w2_routing = _routing(tokens, seed=8, repeat=True)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_routing)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_experts(x, ids, w, w13, w2, LIMIT))


def test_aot_cubins_equal_jit(weights, tmp_path):
    from deepinfer_cuda.kernel_set.build import build_kernel_set
    from deepinfer_cuda.kernel_set.dispatch import DEFAULT_KERNEL_SET_DIR, device_arch, use_kernel_set
    from deepinfer_cuda.kernels.moe_experts import COMBINE_KERNEL, DOWN_KERNEL, UP_KERNEL, moe_experts
    from deepinfer_cuda.kernels.moe_routing import COUNT_KERNEL, PLAN_KERNEL, SCAN_KERNEL, SCATTER_KERNEL

    w13, w2 = weights
    arch = device_arch(torch.cuda.current_device())
    kernels = (PLAN_KERNEL, COUNT_KERNEL, SCAN_KERNEL, SCATTER_KERNEL, UP_KERNEL, DOWN_KERNEL, COMBINE_KERNEL)
    build_kernel_set(tmp_path, [arch], kernels=[k.name for k in kernels])
    cases = [_routing(n, seed=n) for n in (4, 16, 1024)]  # narrow decode tiles, decode tiles, prefill (chunked plan)
    try:
        use_kernel_set(tmp_path)
        aot = [moe_experts(x, ids, w, w13, w2, LIMIT) for x, ids, w in cases]
        for kernel, launches in zip(kernels, (2, 1, 1, 1, 3, 3, 3), strict=True):
            assert kernel.launch_counts == {"cubin": launches, "jit": 0}, (kernel.name, kernel.launch_counts)
        use_kernel_set(None)
        jit = [moe_experts(x, ids, w, w13, w2, LIMIT) for x, ids, w in cases]
    finally:
        use_kernel_set(DEFAULT_KERNEL_SET_DIR)
    assert all(torch.equal(a, j) for a, j in zip(aot, jit, strict=True))

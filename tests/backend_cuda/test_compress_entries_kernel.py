"""The fused compressor-entry kernel: its cubins cover the V4 model's calls (CPU), its tile path with overlap and
unaligned widths under Triton's interpreter (CPU), and on the GPU it agrees with the composed kernels it replaces
(compress_pool -> rms_norm -> rope) at V4-Flash shapes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda.arch import SM90A  # noqa: E402
from deepinfer_cuda.kernels import compress_entries  # noqa: E402

BF16 = torch.bfloat16
INV_FREQ = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def _inputs(n: int, ratio: int, dim: int, overlap: bool, masked: bool, dtype=BF16, device="cpu", gen=None):
    """Compressor inputs as the V4 model passes them: model-dtype projections, fp32 bias / norm weight."""
    width = 2 * dim if overlap else dim

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    previous = randn(n, ratio, 2 * dim, dtype=dtype) if overlap else None
    has_previous = (torch.arange(n, device=device) % 3 != 0) if masked else None
    positions = ratio * torch.randint(0, 1 << 18, (n,), generator=gen, device=device)
    return (randn(n, ratio, 2 * width, dtype=dtype), previous, has_previous, randn(ratio, width),
            1 + 0.1 * randn(dim), 1e-6, positions, INV_FREQ.to(device), 1.0)


def _covered(launch) -> bool:
    return compress_entries.KERNEL.has_aot_variant(launch, SM90A)


@pytest.mark.parametrize("n", [1, 17, 64])
@pytest.mark.parametrize("shape", [(4, 512, True, True), (4, 512, True, False), (4, 128, True, True),
                                   (4, 128, True, False), (128, 512, False, False)],
                         ids=["csa", "csa_all_prev", "indexer", "indexer_all_prev", "hca"])
@pytest.mark.parametrize("decode", [False, True], ids=["all_needed", "closing_only"])
def test_v4_calls_find_a_cubin(n, shape, decode):
    needed = torch.arange(n) % 4 == 3 if decode else None  # decode: only the windows closing at the token
    assert _covered(compress_entries.prepare(*_inputs(n, *shape), needed, arch=SM90A))


SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    import triton.language as tl
    from deepinfer.ops.compress import compress_entries as reference
    from deepinfer.testing.conformance import assert_close
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import compress_entries as module

    module.libdevice = types.SimpleNamespace(cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x))
    module.INTERPRETED = True
    gen = torch.Generator().manual_seed(0)
    # (n, ratio, dim, rope dim, overlap): 256 slots with overlap go 32 channels a tile (the tile path with the
    # predecessor's slots); 96 channels pad to 128 (masked columns in both paths).
    for n, ratio, dim, rope_dim, overlap in [(3, 128, 128, 64, True), (4, 4, 96, 32, True), (2, 128, 96, 16, False)]:
        for dtype in (torch.float32, torch.bfloat16):
            width = 2 * dim if overlap else dim
            window = torch.randn(n, ratio, 2 * width, generator=gen).to(dtype)
            previous = torch.randn(n, ratio, 2 * dim, generator=gen).to(dtype) if overlap else None
            has_previous = torch.tensor([i % 2 == 1 for i in range(n)]) if overlap else None
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
            args = (window, previous, has_previous, torch.randn(ratio, width, generator=gen),
                    1 + 0.1 * torch.randn(dim, generator=gen), 1e-6, ratio * torch.randint(0, 999, (n,), generator=gen),
                    inv_freq, 0.5)
            plan = module.prepare(*args, arch=SM90A)
            assert (plan.args["BLOCK_C"] < dim) == (ratio >= 64), plan.args
            module.KERNEL.jit_fn[plan.grid](**plan.args, num_warps=plan.config.num_warps, num_stages=1)
            tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
            assert_close(plan.result, reference(*args), dtype, tol, f"{n}x{ratio}x{dim} overlap={overlap} {dtype}")
            print("OK", n, ratio, dim, dtype)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the GPU tests below check the kernel itself")
def test_tile_path_with_overlap_and_padded_widths_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 6, proc.stdout


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100)")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 64, 300])
@pytest.mark.parametrize("shape", [(4, 512, True, True), (4, 128, True, False), (128, 512, False, False)],
                         ids=["csa", "indexer", "hca"])
def test_matches_the_composed_kernels_on_the_gpu(n, shape):
    """Against compress_pool -> rms_norm -> rope (the kernels the model ran before): the same roundings, so at
    most a bf16 ulp apart where an fp32 sum's order differs."""
    from deepinfer.ops.compress import _slots
    from deepinfer_cuda.kernels.compress_pool import compress_pool
    from deepinfer_cuda.kernels.rms_norm import rms_norm
    from deepinfer_cuda.kernels.rope import rope

    gen = torch.Generator(device="cuda").manual_seed(n)
    args = _inputs(n, *shape, device="cuda", gen=gen)
    window, previous, has_previous, bias, weight, eps, positions, inv_freq, scaling = args
    composed = rope(rms_norm(compress_pool(*_slots(window, previous, has_previous, bias)), weight, eps), positions,
                    inv_freq, scaling)
    fused = compress_entries.compress_entries(*args)
    torch.testing.assert_close(fused.float(), composed.float(), atol=2e-2, rtol=1.6e-2)
    assert (fused != composed).float().mean() < 0.01  # bitwise equal nearly everywhere


@requires_cuda
@pytest.mark.cuda
def test_is_graph_capturable_and_syncless():
    from deepinfer_cuda.plugin import CudaBackend

    backend = CudaBackend()
    args = _inputs(16, 4, 512, True, True, device="cuda")
    out = torch.empty(16, 512, dtype=BF16, device="cuda")
    compress_entries.compress_entries(*args)  # compiled (JIT) before the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        expected = compress_entries.compress_entries(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with backend.graph_capture(backend.device()) as capture:
        replay = capture(lambda: out.copy_(compress_entries.compress_entries(*args)))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)

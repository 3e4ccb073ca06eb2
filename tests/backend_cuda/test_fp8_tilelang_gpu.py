"""The TileLang FP8 GEMM on the GPU host: every variant the kernel set holds, at V4.1-Flash's projection shapes and
its tier's row counts, against core's reference (the dequantized bf16 weight, fp32 sums: the forms differ only in
the order of the sums), the same bits run after run (two programs an SM share its shared memory: the weight-stage
release must wait for the wgmma, ``release_weights_after_mma``) and from a CUDA graph's replay.  Skipped without
an SM90 GPU or without the TileLang cubins (a kernel set built where TileLang and nvcc were installed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda import arch  # noqa: E402
from deepinfer_cuda.arch import FP8_TILELANG_CANDIDATES, SM90A  # noqa: E402
from deepinfer_cuda.kernels import fp8_block_linear, fp8_block_linear_tl  # noqa: E402

BLOCK = 32
CASES = [(shape, tier, tiles) for shape, tiers in FP8_TILELANG_CANDIDATES.items() for tier, forms in tiers.items()
         for tiles in forms]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU; run on the GPU host")


@pytest.mark.parametrize(("shape", "tier", "tiles"), CASES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}-{t}-{f}" for s, t, f in CASES])
def test_each_variant_matches_the_reference_the_same_bits_every_run(shape, tier, tiles, monkeypatch):
    from deepinfer.ops.quant_gemm import fp8_block_grouped_linear
    from deepinfer.ops.quant_gemm import fp8_block_linear as reference

    n, k, groups, block = shape
    if not fp8_block_linear_tl.KERNEL.available(SM90A, fp8_block_linear_tl._variant(tiles, n, k, groups, block)):
        pytest.skip("the active kernel set has no TileLang FP8 cubins")
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    codes = (torch.randn(groups * n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.randint(-16, -12, (groups * n // block, k // block), device="cuda", generator=gen) + 127
             ).to(torch.uint8).view(torch.float8_e8m0fnu)
    # the prefill candidates serve the chunk tier too (65 rows) and the prefill tier (300: a ragged last tile)
    monkeypatch.setitem(arch.FP8_TILELANG, shape, {tier: tiles, **({"chunk": tiles} if tier == "prefill" else {})})
    for rows in {"decode": (2, 16), "batch": (17, 64), "prefill": (65, 300)}[tier]:
        x = torch.randn(rows, groups, k, device="cuda", generator=gen).bfloat16()
        x = x if groups > 1 else x[:, 0]
        want = (fp8_block_grouped_linear if groups > 1 else reference)(x, codes, scale, block, block).float()

        def run(x=x):
            chain = fp8_block_linear.plan_gemm(x, codes, scale, block, block, groups, arch=SM90A, interpreted=False)
            assert chain.steps[0][0] is fp8_block_linear_tl.KERNEL
            return chain.run(0)

        got = run()
        err = ((got.float().view_as(want) - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (rows, err)
        folded = fp8_block_linear_tl._variant(tiles, n, k, groups, block, 1)
        if fp8_block_linear_tl.KERNEL.available(SM90A, folded):  # the one-multiply decode: the same exact values
            monkeypatch.setattr(arch, "FP8_FOLDED_DECODE", True)
            assert torch.equal(run(), got), rows
            monkeypatch.setattr(arch, "FP8_FOLDED_DECODE", False)
        for _ in range(20):  # the occupancy-2 race showed as outputs differing run to run
            assert torch.equal(run(), got), rows
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = run()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got), rows

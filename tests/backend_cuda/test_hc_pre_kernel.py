"""The split-K ``hc_pre`` kernels beyond the conformance samples: several K slices and token tiles, a partial last
slice and hidden chunk, agreement with the reference, and batch invariance (a token's bits never depend on the
other tokens of the call).

CPU (CI): Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must precede Triton's decorators).  The
interpreter's fp32 arithmetic is numpy's, so bitwise invariance here proves the indexing (slots, masks, fixed
tiles); on the GPU ``test_batch_invariance_gpu.py`` checks the compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer.ops.mhc import hc_pre as reference
    from deepinfer.testing.conformance import assert_close
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import hc_pre as module

    torch.set_num_threads(1)

    def run(*args):
        plan = module.prepare(*args, arch=SM90A)
        for kernel, launch in plan.steps:
            if all(g > 0 for g in launch.grid):
                kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                           num_stages=launch.config.num_stages)
        return plan.finish()

    gen = torch.Generator().manual_seed(0)
    # (tokens, streams, hidden, dtype): 40 tokens in 32-token tiles (the last partial) x 4 slices; a flat width
    # (800) that ends mid-slice and a hidden dim (200) that ends mid-chunk; one token alone; 70 tokens in the
    # largest tier.  4 Sinkhorn rounds keep it fast (the conformance samples run 20).
    cases = [(40, 4, 256, torch.float32), (5, 4, 200, torch.float32), (5, 4, 200, torch.bfloat16),
             (1, 4, 512, torch.bfloat16), (70, 4, 128, torch.bfloat16)]
    for tokens, n, dim, dtype in cases:
        if True:
            streams = (2 * torch.randn(tokens, n, dim, generator=gen)).to(dtype)
            fn = 0.05 * torch.randn((2 + n) * n, n * dim, generator=gen)
            base = 0.5 * torch.randn((2 + n) * n, generator=gen)
            scale = 1 + 0.1 * torch.randn(3, generator=gen)
            args = (streams, fn, base, scale, 1e-6, 1e-6, 4)
            tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
            for interpreted in ((False, True) if dtype == torch.float32 else (True,)):
                # tl.dot (the compiled path) runs as numpy matmul here, whose rounding of a row depends on its
                # place in the tile and the tile's size (and whose bf16 dot is wrong: bf16 streams take the
                # tensor-core path, checked on the GPU); INTERPRETED multiplies product by product in the
                # compiled order, so every sub-batch (each in its own token tier) can be compared bitwise.
                module.INTERPRETED = interpreted
                whole = run(*args)
                assert_close(whole, reference(*args), dtype, tol, f"hc_pre {tokens}x{n}x{dim} {dtype}")
                if not interpreted:
                    continue
                for rows in [[tokens - 1], list(range(tokens - 1, -1, -3))]:
                    part = run(streams[rows], *args[1:])
                    for got, want in zip(part, whole):
                        assert torch.equal(got, want[rows]), f"rows {rows[:4]} of {tokens}x{n}x{dim} {dtype} differ"
            print("OK", tokens, n, dim, dtype)
    """
)


# slow: minutes under the interpreter on 2 cores; test_kernels_interpreted covers hc_pre.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_gpu_kernels.py checks the kernels")
def test_split_k_hc_pre_matches_reference_and_is_batch_invariant_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 5, proc.stdout


def test_hc_pre_tiles_depend_on_model_dims_only():
    """The K split and every finishing tile are a function of (streams, hidden): plans for 1..1000 tokens agree on
    them; only the projection's token tile (and its warps) follows the token count, through the tiers."""
    from deepinfer_cuda.arch import SM90A, SM100A, hc_pre_config
    from deepinfer_cuda.kernels import hc_pre as module

    for arch in (SM90A, SM100A):
        for n, dim in module.AOT_SHAPES:
            tiles = hc_pre_config(arch, n, dim)
            assert [t.max_tokens for t in tiles.tiers] == sorted(t.max_tokens for t in tiles.tiers)
            plans = []
            for tokens in (1, 3, 16, 64, 65, 1000):
                plan = module.prepare(torch.zeros(tokens, n, dim, dtype=torch.bfloat16), torch.zeros(24, n * dim),
                                      torch.zeros(24), torch.ones(3), 1e-6, 1e-6, 20, arch=arch)
                (_, mix), (_, finish) = plan.steps
                consts = {k: v for launch in (mix, finish) for k, v in launch.args.items()
                          if k.isupper() and k != "BLOCK_T"}
                tier = tiles.tier(tokens)
                assert mix.args["BLOCK_T"] == tier.block_t and mix.config == tier.config
                plans.append((consts, finish.config, mix.grid[1], finish.grid[1]))
                assert mix.grid[0] * tier.block_t >= tokens and finish.grid[0] == tokens
            assert all(p == plans[0] for p in plans)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_hc_pre_bits_do_not_depend_on_the_token_tier_gpu():
    """Compiled kernels: a token's outputs are bitwise the same whether the call's tier tiles it by 1, 2..8, 16 or
    64 tokens (each mix is one FMA chain over its slice, whatever the tile)."""
    from deepinfer_cuda.kernels.hc_pre import hc_pre

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        streams = torch.randn(200, 4, 4096, device="cuda", generator=gen).to(dtype)
        fn = 0.05 * torch.randn(24, 4 * 4096, device="cuda", generator=gen)
        base = 0.5 * torch.randn(24, device="cuda", generator=gen)
        scale = 1 + 0.1 * torch.randn(3, device="cuda", generator=gen)
        whole = hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20)
        for rows in ([7], [199, 3], list(range(5, 12)), list(range(150, 166)), list(range(0, 200, 4))):
            part = hc_pre(streams[rows], fn, base, scale, 1e-6, 1e-6, 20)
            for got, want in zip(part, whole, strict=True):
                assert torch.equal(got, want[rows]), f"{len(rows)} rows {rows[:3]} ({dtype}) differ from the batch"

"""The MoE experts' prefill tier on the CPU, under Triton's interpreter: the conformance samples stay below 32
slots per expert, so neither the prefill tiles (128-row blocks, wide column tiles, 8 warps) nor the column-inner
program order are reached there.

- with the prefill tier's tiles (several blocks per expert, a partial last block, a partial column tile), the op
  is as close to core's reference as the conformance tolerances ask in fp32, and in bf16 as accurate as the
  reference against an fp32 oracle (a few of 48000 bf16 outputs are an ulp or two off the reference's, from
  projections rounded the other way: the interpreter's dot sums in another order than torch's);
- the column-inner program order (``MoeTiles.cols_inner``) gives the same bits as the block-inner one: the order
  only changes which program runs when, not what any program computes;
- every sweep candidate of ``tools.sweep.moe_prefill`` turns into valid tiles (its kernel's tiles are the
  candidate's, the other kernel's the base of the same block rows).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import torch
    from deepinfer.ops.moe import moe_experts as reference
    from deepinfer.ops import op_defs
    from deepinfer.testing.conformance import assert_close
    from deepinfer_cuda.arch import SM90A, moe_experts_config
    from deepinfer_cuda.kernels import moe_experts as moe

    torch.set_num_threads(1)
    moe.INTERPRETED = True
    gen = torch.Generator().manual_seed(0)

    def run(plan):
        for kernel, l in plan.steps:
            if all(g > 0 for g in l.grid):
                kernel.jit_fn[l.grid](**l.args, num_warps=l.config.num_warps, num_stages=l.config.num_stages)
        return plan.finish()

    tol = op_defs()["moe_experts"].tolerances
    # 4 experts, 300 tokens x top-2 = 600 slots (~150 an expert: a full and a partial block each);
    # inter 96 under a 128-column up tile and hidden 160 under a 256-column down tile: partial column tiles
    for tokens, hidden, inter, experts, top_k, dtype in [(300, 160, 96, 4, 2, torch.bfloat16),
                                                         (140, 64, 48, 2, 2, torch.float32)]:
        x = (3 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        w = torch.rand(tokens, top_k, generator=gen)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5 * 4).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        args = (x, ids, w, w13, w2, 10.0)
        tiles = moe_experts_config(SM90A, tokens * top_k // experts, hidden, inter, x.element_size())
        assert tokens * top_k // experts > tiles.block_m >= 64
        if dtype == torch.bfloat16:
            assert tiles.up_block_n > inter and tiles.down_block_n > hidden, tiles
        ours = run(moe.prepare(*args, arch=SM90A))
        expected = reference(*args)
        if dtype == torch.float32:
            assert_close(ours, expected, dtype, tol[dtype], f"prefill tiles {tokens}x{hidden} {dtype}")
        else:  # bf16: a projection rounded the other way flips a few outputs by an ulp or two (summation order)
            oracle = reference(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
            ours_err, ref_err = ((t.float() - oracle).abs() for t in (ours, expected))
            assert ours_err.max() <= 1.25 * ref_err.max() and ours_err.mean() <= 1.05 * ref_err.mean(), (
                ours_err.max(), ref_err.max(), ours_err.mean(), ref_err.mean())
            off = (ours.float() - expected.float()).abs() > 0.02 * expected.float().abs() + 0.02
            assert off.float().mean() < 1e-3, off.sum()
        flipped = dataclasses.replace(tiles, cols_inner=not tiles.cols_inner)
        plan = moe.prepare(*args, arch=SM90A, tiles=flipped)
        up = plan.steps[-3][1]
        assert up.grid[0 if flipped.cols_inner else 1] == -(-inter // tiles.up_block_n), up.grid
        assert torch.equal(run(plan), ours), "program order changed the result"
    print("OK prefill")
    """
)


# slow: minutes under the interpreter on 2 cores; test_kernels_interpreted covers moe_experts.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_gpu_moe.py checks the compiled kernels")
def test_moe_prefill_tiles_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == ["OK", "prefill"], proc.stdout


def test_sweep_candidates_make_valid_tiles():
    from deepinfer_cuda.arch import SM90A, moe_experts_config
    from tools.sweep import moe_prefill as sweep

    cands = sweep.candidates()
    assert len(cands) == len(set(cands)) and len(cands) <= 40
    for c in cands:
        tiles = sweep.tiles_of(c)
        assert sweep.from_tiles(c.kernel, tiles) == c
        other = "down" if c.kernel == "up" else "up"
        assert sweep.from_tiles(other, tiles).block_m == c.block_m
    default = moe_experts_config(SM90A, 96, 4096, 2048)
    assert dataclasses.replace(sweep.tiles_of(sweep.from_tiles("up", default)), down=default.down,
                               down_block_n=default.down_block_n, down_block_k=default.down_block_k) == default

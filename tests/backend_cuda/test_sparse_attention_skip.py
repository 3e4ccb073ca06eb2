"""Sparse attention walks only the chunks between a row's first and last valid index: the same bits as walking all.

Prefill rows are mostly -1 at both ends (a window that starts before the sequence, top-k slots past the visible
entries), so the kernel skips those chunks (``SparseAttentionTiles.skip_empty``).  Skipping is exact only because
a chunk of -1 leaves the split's softmax state bit for bit as it is; these tests check that claim on rows whose
live columns start and end inside splits and inside chunks, in both regimes, with skipping on and off, for both
forms of the products (``transposed``) (under Triton's interpreter on CPU; the GPU runs the default tiles in
test_sparse_attention_splits.py and every candidate in tools/sweep/sparse_attention.py).
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
    import dataclasses
    import os
    import torch
    from deepinfer.ops import op_defs
    from deepinfer.testing.conformance import assert_close
    from deepinfer_cuda.arch import SM90A, sparse_attention_config
    from deepinfer_cuda.kernels import sparse_attention as module

    torch.set_num_threads(1)
    DEVICE = os.environ.get("SKIP_TEST_DEVICE", "cpu")
    module.INTERPRETED = DEVICE == "cpu"
    OP = op_defs()["sparse_attention"]


    def run(plan):
        for kernel, launch in plan.steps:
            kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                       num_stages=launch.config.num_stages)
        return plan.finish()


    checked = 0
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        tiles = sparse_attention_config(SM90A, 16, 64, torch.tensor([], dtype=dtype).element_size())
        sn, bn = tiles.split_n, tiles.block_n
        width = 3 * sn + 5
        q = torch.randn(5, 16, 64, generator=gen).to(dtype).to(DEVICE)
        kv = torch.randn(90, 64, generator=gen).to(dtype).to(DEVICE)
        sinks = torch.randn(16, generator=gen).to(DEVICE)
        idx = torch.randint(0, 90, (5, width), generator=gen).to(DEVICE)
        idx[0, :sn + bn + 3] = -1                   # leading -1 past a split and into a chunk (a window's start)
        idx[1, 2 * sn - 3:] = -1                    # trailing -1 from inside a chunk (unused top-k slots)
        idx[2, :bn + 1] = -1
        idx[2, sn + 1:] = -1                        # one live stretch, its last column the first of a split
        idx[3, : width - 1] = -1                    # only the very last column
        idx[4, sn:2 * sn] = -1                      # a whole split of -1 between live columns
        for trans in (False, True):  # either form of the products (another compiled variant, its own bits)
            outs = {}
            for skip in (True, False):
                for split in (True, False):
                    t = dataclasses.replace(tiles, skip_empty=skip, transposed=trans)
                    outs[skip, split] = run(module.prepare(q, kv, idx, sinks, 0.125, arch=SM90A, split=split,
                                                           tiles=t))
            first = outs[True, True]
            for key, out in outs.items():
                assert torch.equal(out, first), f"transposed {trans}, skip/split {key} differs"
            for row in range(5):  # each row alone: the same bits
                t = dataclasses.replace(tiles, transposed=trans)
                alone = run(module.prepare(q[row:row + 1], kv, idx[row:row + 1], sinks, 0.125, arch=SM90A,
                                           split=True, tiles=t))
                assert torch.equal(alone[0], first[row]), (trans, row)
            expected = OP.reference(q.cpu(), kv.cpu(), idx.cpu(), sinks.cpu(), 0.125)
            assert_close(first.cpu(), expected, dtype, OP.tolerances[dtype], "skip")
            checked += 1
    print("CHECKED", checked)
    """
)


def _run_script(env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "CHECKED 4" in proc.stdout, proc.stdout


# slow: minutes under the interpreter on 2 cores; test_kernels_interpreted covers sparse_attention.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_skipping_chunks_on_the_gpu runs instead "
                    "(Triton 3.6's interpreter fails on numpy 2.5 there)")
def test_skipping_chunks_of_padding_keeps_the_bits_under_the_triton_interpreter():
    _run_script({**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")
@pytest.mark.cuda
def test_skipping_chunks_on_the_gpu():
    _run_script({**os.environ, "SKIP_TEST_DEVICE": "cuda"})


def test_live_chunk_range_is_a_compile_time_choice_of_the_tiles():
    # The flag is a constexpr of the kernel (one AOT variant per setting), taken from the tiles, default on.
    from deepinfer_cuda.arch import SM90A, sparse_attention_config
    from deepinfer_cuda.kernels.sparse_attention import prepare

    tiles = sparse_attention_config(SM90A, 64, 512, 2)
    assert tiles.skip_empty
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    plan = prepare(q, torch.zeros(4, 512, dtype=torch.bfloat16), torch.full((2, 640), -1), torch.zeros(64), 0.1,
                   arch=SM90A)
    assert plan.steps[0][1].args["SKIP_EMPTY"] is True

"""The indexers' top-k kernel (``top_entries.py``) under Triton's interpreter against torch's ``topk``, and its plan:
one launch for rows up to ``MAX_BLOCK`` entries, torch beyond.  The indexer ops run it in the conformance sweep
(``test_kernels_interpreted.py``) and on the GPU (``test_gpu_kernels.py``)."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda.arch import SM90A  # noqa: E402
from deepinfer_cuda.kernels import top_entries  # noqa: E402
from tests.support.interpreter import run_interpreted  # noqa: E402


def test_rows_up_to_max_block_take_one_launch_longer_ones_torch():
    steps, _ = top_entries.plan(torch.zeros(3, 2048), 512)
    assert [k.name for k, _ in steps] == ["top_entries"] and steps[0][1].args["BLOCK"] == 2048
    assert top_entries.KERNEL.has_aot_variant(steps[0][1], SM90A)  # V4.1-Flash's index_topk at 2048 entries
    scores = torch.randn(2, top_entries.MAX_BLOCK + 1)
    steps, finish = top_entries.plan(scores, 512)
    assert steps == [] and torch.equal(finish(), top_entries.torch_top_entries(scores, 512))


SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer_cuda.kernels import top_entries as te

    gen = torch.Generator().manual_seed(0)
    for tokens, entries, topk in ((3, 300, 256), (2, 40, 64), (1, 1, 16)):
        scores = torch.randn(tokens, entries, generator=gen)
        scores[0, entries // 2:] = float("-inf")  # a query with fewer causal entries than topk
        if entries > 8:
            scores[-1, 3] = scores[-1, 7] = 5.0  # a tie: the lower entry first
            scores[-1, 5] = -0.0  # signed zeros and negatives keep the float order
        steps, finish = te.plan(scores, topk)
        for kernel, launch in steps:
            kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
        ids = finish()
        want = te.torch_top_entries(scores, topk)
        kept = want >= 0
        assert torch.equal(ids >= 0, kept), (ids, want)
        picked = scores.gather(1, ids.clamp(min=0))
        assert torch.equal(picked[kept], scores.gather(1, want.clamp(min=0))[kept])  # the same scores, best first
        if entries > 8:
            row = ids[-1].tolist()
            assert row.index(3) + 1 == row.index(7), row
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the indexer ops' GPU tests run the cubins")
def test_the_kernel_under_the_interpreter_picks_torchs_scores_best_first():
    assert run_interpreted(SCRIPT, timeout=300).split() == ["OK"]

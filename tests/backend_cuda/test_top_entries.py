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
    steps, _ = top_entries.plan(torch.zeros(3, 2048), 512, top_entries.MAX_BLOCK)
    assert [k.name for k, _ in steps] == ["top_entries"] and steps[0][1].args["BLOCK"] == 2048
    assert top_entries.KERNEL.has_aot_variant(steps[0][1], SM90A)  # V4.1-Flash's index_topk at 2048 entries
    scores = torch.randn(2, top_entries.MAX_BLOCK + 1)
    steps, finish = top_entries.plan(scores, 512, top_entries.MAX_BLOCK)
    assert steps == [] and torch.equal(finish(), top_entries.torch_top_entries(scores, 512))
    assert top_entries.plan(torch.zeros(3, 2048), 512, 1024)[0] == []  # the adoption limit


def _cases(gen, device="cpu"):
    for tokens, entries, topk in ((3, 300, 256), (2, 40, 64), (1, 1, 16)):
        scores = torch.randn(tokens, entries, generator=gen, device=device)
        scores[0, entries // 2:] = float("-inf")  # a query with fewer causal entries than topk
        if entries > 8:
            scores[-1, 3] = scores[-1, 7] = 5.0  # a tie: the lower entry first
            scores[-1, 5] = -0.0  # signed zeros and negatives keep the float order
        yield scores, topk


def _check(scores, topk, ids, tie=True):
    want = top_entries.torch_top_entries(scores, topk)
    kept = want >= 0
    assert torch.equal(ids >= 0, kept), (ids, want)
    picked = scores.gather(1, ids.clamp(min=0))
    assert torch.equal(picked[kept], scores.gather(1, want.clamp(min=0))[kept])  # the same scores, best first
    if tie and scores.shape[1] > 8:
        row = ids[-1].tolist()
        assert row.index(3) + 1 == row.index(7), row


SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer_cuda.kernels import top_entries as te
    from tests.backend_cuda.test_top_entries import _cases, _check

    for scores, topk in _cases(torch.Generator().manual_seed(0)):
        steps, finish = te.plan(scores, topk, te.MAX_BLOCK)
        for kernel, launch in steps:
            kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
        _check(scores, topk, finish())
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the indexer ops' GPU tests run the cubins")
def test_the_kernel_under_the_interpreter_picks_torchs_scores_best_first():
    assert run_interpreted(SCRIPT, timeout=300).split() == ["OK"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100)")
def test_the_kernel_on_the_gpu_picks_torchs_scores_best_first():
    """The compiled kernel (cubin where the set has the variant), and a V4.1-Flash row of 2048 entries."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(4, 2048, generator=gen, device="cuda")
    big[1, 700:] = float("-inf")
    for scores, topk in [*_cases(gen, "cuda"), (big, 512)]:
        steps, finish = top_entries.plan(scores, topk, top_entries.MAX_BLOCK)
        for kernel, launch in steps:
            launch.run(kernel, 0)
        _check(scores, topk, finish(), tie=scores is not big)

"""The CUDA ``verify_drafts`` decides as core's reference does: same acceptances, same tokens.

Stricter than the op's conformance comparison (which forgives near-ties): on random inputs no race is decided by
rounding, so tokens and counts must be equal.  Cases: greedy and sampled requests mixed, drafts of a coupled
drafter (a blurred target raced with the same noise: most pass, some do not) sliced out of a wider tensor (as
``spec_decode/verify.py`` passes them), every draft count from 0 to K, all drafts accepted, the first rejected, a
negative draft, no drafts at all (K = 0), greedy ties across chunks (argmax takes the first), and drafts the op
ignores (the tokens must not change with them).  Vocabularies span several chunks.

CPU (CI): Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must precede Triton's decorators), small.
GPU host: V4's vocabulary (129280), up to 64 requests x 4 drafts; no host sync, and a CUDA graph replays it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.interpreter import run_interpreted

pytest.importorskip("triton")

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")


def _verify(*args):
    """The backend's result: the op on a GPU, Triton's interpreter on the CPU."""
    from deepinfer_cuda.kernels import verify_drafts as module

    if args[0].is_cuda:
        return module.verify_drafts(*args)
    from deepinfer_cuda.arch import SM90A

    plan = module.prepare(*args, arch=SM90A)
    for kernel, launch in plan.steps:
        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
    return plan.finish()


def verify_cases(batch: int, k: int, vocab: int, seed: int = 0):
    """(label, args on the CPU): the inputs described in the module docstring."""
    from deepinfer.ops.speculative import _own_tokens

    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 3
    greedy = torch.arange(batch) % 3 == 0
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    steps = torch.randint(0, 2**33, (batch,), generator=gen, dtype=torch.int64)  # positions past 2^32 wrap
    num = torch.arange(batch) % (k + 1)
    num[:2] = k
    blurred = target + torch.randn(batch, k + 1, vocab, generator=gen)
    drafts = _own_tokens(blurred, greedy, seeds, steps)[:, :k].clone()
    exact = _own_tokens(target, greedy, seeds, steps)[:, :k].clone()
    if k:
        drafts[min(1, batch - 1)] = exact[min(1, batch - 1)]  # every draft accepted (the only request at b1)
        if batch > 2:
            drafts[2, 0] = (exact[2, 0] + 1) % vocab  # the first rejected
        drafts[-1, -1] = -1  # no draft: always rejected
    wide = torch.cat([drafts, torch.zeros(batch, 2, dtype=torch.int64)], dim=1)[:, :k]  # strided
    yield "mixed, coupled drafts", (target, greedy, wide, num, seeds, steps)
    yield "all sampled, random drafts", (target, torch.zeros(batch, dtype=torch.bool),
                                          torch.randint(0, vocab, (batch, k), generator=gen), num, seeds, steps)
    tied = target.clone()
    tied[:, :, [7, vocab - 1]] = 50.0  # the same maximum in the first and the last chunk
    tied_drafts = torch.full((batch, k), vocab - 1)
    tied_drafts[::2] = 7
    yield "greedy ties", (tied, torch.ones(batch, dtype=torch.bool), tied_drafts, num, seeds, steps)


def check_verify_kernel(device: str, batch: int, k: int, vocab: int) -> None:
    from deepinfer.ops.registry import OpSample
    from deepinfer.ops.speculative import _compare_verified, verify_drafts

    for kk in sorted({0, k}):
        for label, args in verify_cases(batch, kk, vocab):
            expected = verify_drafts(*args)
            got = _verify(*(a.to(device) for a in args))
            _compare_verified(got, expected, OpSample(args), torch.float32)  # says which decision differs
            tokens, accepted = (t.cpu() for t in got)
            where = f"{label}, K={kk}"
            assert torch.equal(accepted, expected[1]), f"{where}: accepted {accepted} != {expected[1]}"
            assert torch.equal(tokens, expected[0]), f"{where}: tokens differ in rows {(tokens != expected[0]).any(1)}"
            if label == "greedy ties":
                assert bool((tokens[torch.arange(batch), accepted] == 7).all())
            if kk and label == "mixed, coupled drafts" and batch > 2:  # both outcomes occur
                assert 0 < int(accepted.sum()) < int(args[3].sum())
            if kk:  # other drafts: the same token at every position both emit
                other = (args[2] + 1) % vocab
                again, _ = (t.cpu() for t in _verify(*(a.to(device) for a in (args[:2] + (other,) + args[3:]))))
                both = (tokens >= 0) & (again >= 0)
                assert torch.equal(tokens[both], again[both]), f"{where}: tokens depend on the drafts"


SCRIPT = f"""
import sys, types
import triton.language as tl
sys.path.insert(0, {str(Path(__file__).parent)!r})
import deepinfer_cuda.kernels.sample_tokens as sampling
sampling.libdevice = types.SimpleNamespace(log=lambda x: tl.log(x))  # no libdevice in the interpreter
from deepinfer_cuda.arch import LaunchConfig
sampling.sample_tokens_config = lambda arch: (LaunchConfig(num_warps=8), 1024)  # 5000 tokens: 5 chunks
import test_verify_drafts_kernel as t
t.check_verify_kernel("cpu", batch=16, k=3, vocab=5000)
t.check_verify_kernel("cpu", batch=1, k=3, vocab=5000)  # the GPU test's b1 cases
print("OK")
"""


@pytest.mark.slow  # ~12 s; the GPU host: test_verify_decides_as_the_reference_on_the_gpu
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the GPU tests below check the kernels")
def test_verify_decides_as_the_reference_under_the_interpreter():
    out = run_interpreted(SCRIPT, timeout=300)
    assert "OK" in out, out


def test_verify_launches_have_aot_variants():
    """What a speculative step launches (V4's vocabulary, 1-64 requests, 0-4 drafts) is compiled ahead."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import verify_drafts

    for batch, k in [(1, 4), (64, 4), (5, 0), (3, 1)]:
        v = 129280
        drafts = torch.zeros(batch, 6, dtype=torch.int64)[:, :k]
        plan = verify_drafts.prepare(torch.zeros(batch, k + 1, v), torch.zeros(batch, dtype=torch.bool), drafts,
                                     torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
                                     torch.zeros(batch, dtype=torch.int64), arch=SM90A)
        assert len(plan.steps) == 1
        for kernel, launch in plan.steps:
            assert kernel.has_aot_variant(launch, SM90A), (kernel.name, batch, k)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_verify_decides_as_the_reference_on_the_gpu(batch):
    check_verify_kernel("cuda", batch=batch, k=4, vocab=129280)


@requires_cuda
@pytest.mark.cuda
def test_verify_step_makes_no_host_sync_and_replays_from_a_cuda_graph():
    from deepinfer_cuda.kernels import verify_drafts
    from tests.support.aot_jit import assert_graph_replays_without_syncs

    cases = [(verify_drafts.verify_drafts, tuple(a.cuda() for a in args))
             for batch in (1, 64) for _, args in verify_cases(batch, 4, 129280)]
    assert_graph_replays_without_syncs(cases, lambda op, args: op(*args))

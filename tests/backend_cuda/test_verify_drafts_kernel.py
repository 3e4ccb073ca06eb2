"""The CUDA ``verify_drafts`` kernels decide as core's reference does: same acceptances, same tokens.

Stricter than the op's conformance comparison (which forgives near-ties): on random inputs no decision lies within
rounding of its threshold, so tokens and counts must be equal.  Cases: greedy and sampled requests mixed, a
drafter's probabilities given (sliced out of wider tensors, as ``spec_decode/verify.py`` passes them) or not (a greedy
drafter), every draft count from 0 to K, all drafts accepted, the first rejected, a negative draft, acceptance
tests 1% from their threshold, no drafts at all (K = 0), greedy ties across chunks (argmax takes the first), and
an unnormalised q that leaves the residual all zero (the draw falls back to p).  Vocabularies span several chunks.

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
    """The kernels' result: the op on a GPU, Triton's interpreter on the CPU."""
    from deepinfer_cuda.kernels import verify_drafts as module

    if args[0].is_cuda:
        return module.verify_drafts(*args)
    from deepinfer_cuda.arch import SM90A

    plan = module.prepare(*args, arch=SM90A)
    for kernel, launch in plan.steps:
        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                   num_stages=launch.config.num_stages)
    return plan.finish()


def verify_cases(batch: int, k: int, vocab: int, seed: int = 0):
    """(label, args on the CPU): the inputs described in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 3
    greedy = torch.arange(batch) % 3 == 0
    # The drafter is the target, blurred: most sampled drafts pass, some do not.
    q = torch.softmax(target[:, :k] + torch.randn(batch, k, vocab, generator=gen), dim=-1)
    drafts = torch.zeros(batch, k, dtype=torch.int64)
    greedy_drafts = target[:, :k].argmax(-1)
    if k:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(batch, k)
        greedy_drafts[1::4, 0] = (greedy_drafts[1::4, 0] + 1) % vocab  # some greedy requests reject their first
        drafts = torch.where(greedy[:, None], greedy_drafts, drafts)
        if batch > 2:  # a sampled request whose first draft is (almost surely) rejected
            drafts[2, 0] = target[2, 0].argmin()
        drafts[-1, -1] = -1  # no draft: always rejected
    num = torch.arange(batch) % (k + 1)
    num[:2] = k
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    steps = torch.randint(0, 2**33, (batch,), generator=gen, dtype=torch.int64)  # positions past 2^32 wrap
    wide_drafts = torch.cat([drafts, torch.zeros(batch, 2, dtype=torch.int64)], dim=1)[:, :k]  # strided, as
    wide_q = torch.cat([q, torch.zeros(batch, 2, vocab)], dim=1)[:, :k]  # spec_decode/verify.py's
    yield "mixed, q given", (target, greedy, wide_drafts, wide_q, num, seeds, steps)
    yield "mixed, greedy drafter", (target, greedy, greedy_drafts, None, num, seeds, steps)
    yield "all sampled, residual all zero", (target, torch.zeros(batch, dtype=torch.bool), drafts,
                                              torch.ones_like(q), num, seeds, steps)
    if k:  # q(x) 1% on either side of p(x) / u: each test decided by the acceptance noise u, bit for bit
        from deepinfer.ops.sampling import uniform_noise
        from deepinfer.ops.speculative import ACCEPT_SALT

        sharp = q.clone()
        p = torch.softmax(target[:, :k], dim=-1)
        for b in range(batch):
            for j in range(k):
                u = uniform_noise(seeds[b : b + 1], (steps[b : b + 1] + j) ^ ACCEPT_SALT, 1)[0, 0].item()
                sharp[b, j, drafts[b, j]] = p[b, j, drafts[b, j]] / u * (1.01 if (b + j) % 3 == 2 else 0.99)
        yield "all sampled, tests at 1% of their threshold", (target, torch.zeros(batch, dtype=torch.bool), drafts,
                                                               sharp, num, seeds, steps)
    tied = target.clone()
    tied[:, :, [7, vocab - 1]] = 50.0  # the same maximum in the first and the last chunk
    tied_drafts = torch.full((batch, k), vocab - 1)
    tied_drafts[::2] = 7
    yield "greedy ties", (tied, torch.ones(batch, dtype=torch.bool), tied_drafts, None, num, seeds, steps)


def check_verify_kernel(device: str, batch: int, k: int, vocab: int) -> None:
    from deepinfer.ops.registry import OpSample
    from deepinfer.ops.speculative import _compare_verified, verify_drafts

    for kk in sorted({0, k}):
        for label, args in verify_cases(batch, kk, vocab):
            expected = verify_drafts(*args)
            got = _verify(*(a.to(device) if a is not None else None for a in args))
            _compare_verified(got, expected, OpSample(args), torch.float32)  # says which decision differs
            tokens, accepted = (t.cpu() for t in got)
            where = f"{label}, K={kk}"
            assert torch.equal(accepted, expected[1]), f"{where}: accepted {accepted} != {expected[1]}"
            assert torch.equal(tokens, expected[0]), f"{where}: tokens differ in rows {(tokens != expected[0]).any(1)}"
            if label == "greedy ties":
                assert bool((tokens[torch.arange(batch), accepted] == 7).all())
            if kk and label == "mixed, q given":  # both outcomes occur
                assert 0 < int(accepted.sum()) < int(args[4].sum())


SCRIPT = f"""
import sys, types
import triton.language as tl
sys.path.insert(0, {str(Path(__file__).parent)!r})
import deepinfer_cuda.kernels.sample_tokens as sampling
import deepinfer_cuda.kernels.verify_drafts as module
ns = types.SimpleNamespace(log=lambda x: tl.log(x), exp=lambda x: tl.exp(x))  # no libdevice in the interpreter
sampling.libdevice = module.libdevice = ns
from deepinfer_cuda.arch import LaunchConfig
# 1024-token chunks reduced 2 at a time: 5 chunks of 5000 tokens take three tiles (V4's 32 chunks take one)
module.verify_drafts_config = lambda arch: (LaunchConfig(num_warps=8), LaunchConfig(num_warps=1), 1024, 2)
import test_verify_drafts_kernel as t
t.check_verify_kernel("cpu", batch=16, k=3, vocab=5000)
print("OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the GPU tests below check the kernels")
def test_verify_kernels_decide_as_the_reference_under_the_interpreter():
    out = run_interpreted(SCRIPT, timeout=300)
    assert "OK" in out, out


def test_verify_launches_have_aot_variants():
    """What a speculative step launches (V4's vocabulary, 1-64 requests, 0-4 drafts, q or not) is compiled ahead."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import verify_drafts

    for batch, k, with_q in [(1, 4, True), (64, 4, False), (5, 0, False), (3, 1, True)]:
        v = 129280
        drafts = torch.zeros(batch, 6, dtype=torch.int64)[:, :k]
        q = torch.zeros(batch, 6, v)[:, :k] if with_q else None
        plan = verify_drafts.prepare(torch.zeros(batch, k + 1, v), torch.zeros(batch, dtype=torch.bool), drafts, q,
                                     torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
                                     torch.zeros(batch, dtype=torch.int64), arch=SM90A)
        assert len(plan.steps) == 3
        for kernel, launch in plan.steps:
            assert kernel.has_aot_variant(launch, SM90A), (kernel.name, batch, k, with_q)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_verify_kernels_decide_as_the_reference_on_the_gpu(batch):
    check_verify_kernel("cuda", batch=batch, k=4, vocab=129280)


@requires_cuda
@pytest.mark.cuda
def test_verify_step_makes_no_host_sync_and_replays_from_a_cuda_graph():
    from deepinfer_cuda.kernels import verify_drafts
    from tests.support.aot_jit import assert_graph_replays_without_syncs

    cases = [(verify_drafts.verify_drafts, tuple(a.cuda() if a is not None else None for a in args))
             for batch in (1, 64) for _, args in verify_cases(batch, 4, 129280)]
    assert_graph_replays_without_syncs(cases, lambda op, args: op(*args))

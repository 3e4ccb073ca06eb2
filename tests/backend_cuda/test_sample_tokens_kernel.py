"""The CUDA ``sample_tokens`` kernel races the reference's noise: same hash bits, same tokens.

The conformance comparison forgives near-ties; these checks are stricter.  With flat logits the race is an argmax
of the hash itself (``-log(-log u)`` is increasing in ``u``), so the drawn token equals the reference's exactly
only if the kernel's uint32 hash of (seed, step, token) is the reference's bit for bit.  Peaked logits check the
race with the log-probabilities; greedy rows take the first of tied maxima, as ``argmax`` does.  Vocabularies span
several chunks of the kernel (4096 tokens) and end mid-chunk.

CPU (CI): Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must precede Triton's decorators).
GPU host: the op itself (AOT cubin or JIT), and a seeded request through ``LLM`` on the tiny V4 model gives
the GPU the CPU's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.interpreter import run_interpreted

pytest.importorskip("triton")

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")


def _draw(logits, greedy, seeds, steps):
    """The kernel's tokens: the op on a GPU, Triton's interpreter on the CPU."""
    from deepinfer_cuda.kernels import sample_tokens as module

    if logits.is_cuda:
        return module.sample_tokens(logits, greedy, seeds, steps).cpu()
    from deepinfer_cuda.arch import SM90A

    plan = module.prepare(logits, greedy, seeds, steps, arch=SM90A)
    for kernel, launch in plan.steps:
        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
    return plan.finish()


def check_sampling_kernel(device: str) -> None:
    from deepinfer.ops.sampling import sample_tokens as reference

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 48, 9000  # three chunks, the last partial
    seeds = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
    seeds[:3] = torch.tensor([0, -1, 2**62])
    steps = torch.randint(0, 2**40, (rows,), generator=gen, dtype=torch.int64)  # positions past 2^32 wrap
    sampled = torch.zeros(rows, dtype=torch.bool)

    def both(logits, greedy):
        args = (logits, greedy, seeds, steps)
        return _draw(*(a.to(device) for a in args)), reference(*args)

    got, expected = both(torch.zeros(rows, vocab), sampled)
    assert torch.equal(got, expected), f"flat logits: hash differs in {(got != expected).sum()} of {rows} rows"
    assert len(set(expected.tolist())) > rows // 2  # the draw is spread over the vocabulary

    peaked = torch.randn(rows, vocab, generator=gen) * 4
    peaked[::5, 5000:] = float("-inf")  # excluded tokens are never drawn
    got, expected = both(peaked, sampled)
    assert torch.equal(got, expected), f"peaked logits: {(got != expected).sum()} of {rows} rows differ"
    assert bool((got[::5] < 5000).all())

    tied = torch.randn(rows, vocab, generator=gen)
    tied[:, [100, 4500, 8999]] = 10.0  # the same maximum in three chunks: argmax takes the first
    greedy = torch.arange(rows) % 2 == 0
    got, expected = both(tied, greedy)
    assert torch.equal(got, expected) and bool((got[greedy] == 100).all())


SCRIPT = f"""
import sys, types
import triton.language as tl
sys.path.insert(0, {str(Path(__file__).parent)!r})
import deepinfer_cuda.kernels.sample_tokens as module
module.libdevice = types.SimpleNamespace(log=lambda x: tl.log(x))  # no libdevice in the interpreter
import test_sample_tokens_kernel as t
t.check_sampling_kernel("cpu")
print("OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the GPU tests below check the kernel")
def test_sampling_kernel_draws_the_reference_tokens_under_the_interpreter():
    out = run_interpreted(SCRIPT, timeout=300)
    assert "OK" in out, out


@requires_cuda
@pytest.mark.cuda
def test_sampling_kernel_draws_the_reference_tokens_on_the_gpu():
    check_sampling_kernel("cuda")


@requires_cuda
@pytest.mark.cuda
def test_seeded_request_samples_the_same_tokens_on_gpu_and_cpu(monkeypatch):
    """fp32 on both; a token may differ only where the CPU's race between the two tokens is within rounding."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.ops.sampling import uniform_noise
    from tests.support.tiny_assets import TINY_V4_DIR

    prompts = [[5, 17, 300, 42, 9], list(range(20, 60))]
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1234, logprobs=1)
    runs = {}
    for accelerator in ("cpu", "nvidia"):
        monkeypatch.setenv("DEEPINFER_ACCELERATOR", accelerator)
        runs[accelerator] = LLM(str(TINY_V4_DIR), dtype="float32").generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    cpu_llm = LLM(str(TINY_V4_DIR), dtype="float32")
    for prompt, cpu, gpu in zip(prompts, runs["cpu"], runs["nvidia"], strict=True):
        mine, theirs = gpu.outputs[0].token_ids, cpu.outputs[0].token_ids
        diverged = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        if diverged is None:
            assert mine == theirs
            continue
        # The CPU's logprob of the GPU's token after the same prefix, teacher forced.
        forced = cpu_llm.generate([prompt + mine[: diverged + 1]],
                                  SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        logp_gpu = forced.prompt_logprobs[len(prompt) + diverged][mine[diverged]].logprob
        logp_cpu = cpu.outputs[0].logprobs[diverged][theirs[diverged]].logprob
        u = uniform_noise(torch.tensor([1234]), torch.tensor([diverged]), max(mine[diverged], theirs[diverged]) + 1)[0]
        race = [lp - torch.log(-torch.log(u[t])).item() for lp, t in ((logp_cpu, theirs[diverged]),
                                                                     (logp_gpu, mine[diverged]))]
        assert abs(race[0] - race[1]) < 1e-2, f"token {diverged} differs with a race gap of {race[0] - race[1]:.3g}"


def test_runtime_keys_of_model_calls_have_an_aot_variant():
    """What the dispatcher looks up for a live call is a key the builder compiles (the H200 run of 2026-11-29
    found ``sample_tokens`` on JIT: its bool pointer was declared ``*i1``, Triton says ``*u1``)."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import compress_pool, sample_tokens

    def covered(module, plan):
        return module.KERNEL.has_aot_variant(plan.steps[0][1] if hasattr(plan, "steps") else plan, SM90A)

    for rows in (1, 5):
        args = (torch.randn(rows, 129280), torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.int64),
                torch.zeros(rows, dtype=torch.int64))
        assert covered(sample_tokens, sample_tokens.prepare(*args, arch=SM90A))
    for windows, slots, dim in [(1, 8, 512), (30, 128, 512), (7, 4, 128)]:
        for dtype in (torch.bfloat16, torch.float32):
            args = (torch.randn(windows, slots, dim).to(dtype), torch.randn(windows, slots, dim))
            assert covered(compress_pool, compress_pool.prepare(*args, arch=SM90A))

"""The MoE router kernel (``deepinfer_cuda/kernels/moe_router.py``) beyond core's conformance samples: V4's expert
counts and top-k, every score function with and without the correction bias, multi-program batches, tied scores
(the lowest expert id wins, picks come in descending biased score), softplus's threshold, rows independent of the
batch; and the model's calls find their cubins in the kernel set.

The math runs under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton
decorates the kernels), on the CPU, against core's reference ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda.arch import SM90A  # noqa: E402
from deepinfer_cuda.kernels import moe_hash_router, moe_router  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from deepinfer.ops import moe as ref
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_hash_router, moe_router

    moe_router.INTERPRETED = moe_hash_router.INTERPRETED = True
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(7)


    def run(plan):
        moe_router.KERNEL.jit_fn[plan.grid](**plan.args, num_warps=plan.config.num_warps,
                                            num_stages=plan.config.num_stages)
        return plan.result


    def oracle_ids(x, w, bias, k, score_func):
        # torch.topk leaves the order of equal scores open; the kernel takes the lowest expert id (stable sort)
        scores = ref._scores(F.linear(x, w).float(), score_func)
        biased = scores if bias is None else scores + bias
        return torch.sort(biased, dim=1, descending=True, stable=True).indices[:, :k]


    def check_router(x, w, bias, k, scale, score_func, dtype, vs_topk=True):
        weights, ids = run(moe_router.prepare(x, w, bias, k, scale, score_func, arch=SM90A))
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (x.shape[0], k)
        expected = oracle_ids(x, w, bias, k, score_func)
        assert torch.equal(ids, expected), (score_func, (ids != expected).nonzero()[:4])
        scores = ref._scores(F.linear(x, w).float(), score_func)
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(weights, ref._normalized(scores, expected, scale), atol=atol, rtol=atol)
        if vs_topk:  # the reference op itself (same expert sets) where no tie straddles the k-th place
            ref._compare_routes((weights, ids), ref.moe_router(x, w, bias, k, scale, score_func), None, dtype)
        return weights, ids


    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        # (tokens, experts, top-k): V4 slice, V4-Flash at top-8, V4.1's 384 (padded to 512); 37 and 9 tokens span
        # several programs with a partial last one (32 / 8 / 4 rows a program)
        for rows, experts, k in ((37, 64, 6), (9, 256, 8), (9, 384, 6), (1, 256, 6)):
            x = torch.randn(rows, 128, generator=gen).to(dtype)
            w = (torch.randn(experts, 128, generator=gen) * 128**-0.5 * 2).to(dtype)
            bias = 0.1 * torch.randn(experts, generator=gen)
            ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)])
            for score_func in ("sqrtsoftplus", "sigmoid", "softmax"):
                for b in (bias, None):
                    if dtype == torch.bfloat16 and b is None:
                        continue  # bf16 logits tie exactly, and torch.topk's pick among ties is not the oracle's
                    check_router(x, w, b, k, 1.5, score_func, dtype)
                    checked += 1
                got = run(moe_hash_router.prepare(x, w, ids, 2.5, score_func, arch=SM90A))
                torch.testing.assert_close(got, ref.moe_hash_router(x, w, ids, 2.5, score_func),
                                           atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)
                checked += 1

    # ties: one-hot rows of x make the logits w's columns.  Row 0: experts 3, 5, 9 and 12 share the top score and
    # 20, 21 the next one, so top-5 is 3, 5, 9, 12 (in id order), then 20, not 21, for every score function.
    # Row 1: logits from 25 up and expert 40's at 100, above softplus's threshold (log1p(exp(100)) overflows fp32):
    # sqrtsoftplus scores are the logits' square roots; sigmoid rounds every one of them to 1.0, a 64-way tie.
    w = torch.zeros(64, 4)
    w[:, 0] = torch.linspace(-1, 0.5, 64)
    w[[3, 5, 9, 12], 0], w[[20, 21], 0] = 2.0, 1.5
    w[:, 1] = 25.0 + torch.arange(64) / 64
    w[40, 1] = 100.0
    x = torch.eye(4)[:2]
    for score_func in ("sqrtsoftplus", "sigmoid", "softmax"):
        weights, ids = check_router(x, w, None, 5, 1.0, score_func, torch.float32, vs_topk=False)
        assert ids[0].tolist() == [3, 5, 9, 12, 20], ids[0]
        assert ids[1].tolist() == ([0, 1, 2, 3, 4] if score_func == "sigmoid" else [40, 63, 62, 61, 60]), ids[1]
        assert torch.all(weights[0, :4] == weights[0, 0])
        checked += 1
    weights, ids = check_router(x[1:], w, None, 2, 1.0, "sqrtsoftplus", torch.float32)
    top = torch.tensor([100.0, 25.0 + 63 / 64]).sqrt()
    torch.testing.assert_close(weights[0], top / top.sum(), atol=0, rtol=1e-6)

    # the correction bias chooses, the unbiased scores weigh: a large bias on expert 0 picks it with its own score
    bias = torch.zeros(64)
    bias[0] = 100.0
    weights, ids = check_router(x[:1], w, bias, 5, 1.5, "sigmoid", torch.float32)
    assert ids[0].tolist() == [0, 3, 5, 9, 12] and weights[0, 0] < weights[0, 1]

    # a row's bits do not depend on the batch: alone, or among others in every slot of a program
    x = torch.randn(40, 128, generator=gen).to(torch.bfloat16)
    w = (torch.randn(256, 128, generator=gen) * 128**-0.5).to(torch.bfloat16)
    bias = 0.1 * torch.randn(256, generator=gen)
    for score_func in ("sqrtsoftplus", "softmax"):
        batch = run(moe_router.prepare(x, w, bias, 6, 1.5, score_func, arch=SM90A))
        for row in (0, 7, 13, 39):
            alone = run(moe_router.prepare(x[row:row + 1], w, bias, 6, 1.5, score_func, arch=SM90A))
            assert torch.equal(alone[0], batch[0][row:row + 1]) and torch.equal(alone[1], batch[1][row:row + 1])
        checked += 1
    print("OK", checked)
    """
)


# slow: minutes under the interpreter on 2 cores; test_kernels_interpreted covers moe_router.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is present: test_gpu_kernels.py checks the compiled kernel")
def test_moe_router_kernel_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.strip().startswith("OK "), proc.stdout


def _covered(module, launch) -> bool:
    return module.KERNEL.has_aot_variant(launch, SM90A)


@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("experts", [64, 256, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_v4_router_calls_find_their_cubins(tokens, experts, dtype):
    """V4's learned router (fp32 correction bias, sqrtsoftplus, top-6) and hash router on the slice's 64, V4-Flash's
    256 and V4.1's 384 experts; also the bias-free and other score functions at top-8."""
    x = torch.randn(tokens, 64, dtype=dtype)
    w = torch.randn(experts, 64, dtype=dtype)
    bias = torch.randn(experts)
    ids = torch.randint(0, experts, (tokens, 6))
    assert _covered(moe_router, moe_router.prepare(x, w, bias, 6, 1.5, "sqrtsoftplus", arch=SM90A))
    assert _covered(moe_hash_router, moe_hash_router.prepare(x, w, ids, 1.5, "sqrtsoftplus", arch=SM90A))
    for score_func in ("sigmoid", "softmax"):
        assert _covered(moe_router, moe_router.prepare(x, w, None, 8, 1.0, score_func, arch=SM90A))
        assert _covered(moe_hash_router, moe_hash_router.prepare(x, w, ids[:, :4].repeat(1, 2), 1.0, score_func,
                                                                  arch=SM90A))


@pytest.mark.parametrize("tokens", [1, 5, 80])
def test_dspark_drafter_router_calls_find_their_cubins(tokens):
    """V4.1-Flash's DSpark drafter: 128 routed experts, top-3, sqrtsoftplus with the selection bias, bf16."""
    x, w = torch.randn(tokens, 64, dtype=torch.bfloat16), torch.randn(128, 64, dtype=torch.bfloat16)
    assert _covered(moe_router, moe_router.prepare(x, w, torch.randn(128), 3, 1.5, "sqrtsoftplus", arch=SM90A))


def test_unknown_score_function_is_refused():
    with pytest.raises(ValueError, match="scoring function"):
        moe_router.prepare(torch.randn(2, 8), torch.randn(4, 8), None, 2, 1.0, "relu", arch=SM90A)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("experts", [64, 256, 384])
def test_gpu_routers_agree_with_torch_without_syncs_and_replay_from_a_graph(experts):
    """On the device: the reference's torch ops pick the same experts (the bias breaks bf16's ties), no host sync (so
    decode graphs can hold the op), and a captured call replays to the eager result.  Small integers in x and
    multiples of 1/512 in w make the logits exact whatever GEMM algorithm runs (eager or captured)."""
    from deepinfer.ops import moe as reference
    from deepinfer_cuda.plugin import CudaBackend

    gen = torch.Generator(device="cuda").manual_seed(0)

    def tokens():
        return torch.randint(-2, 3, (300, 4096), device="cuda", generator=gen).bfloat16()

    x = tokens()
    w = (torch.randint(-2, 3, (experts, 4096), device="cuda", generator=gen) / 512).bfloat16()
    bias = 0.1 * torch.randn(experts, device="cuda", generator=gen)
    ids = torch.randint(0, experts, (300, 6), device="cuda", generator=gen)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = moe_router.moe_router(x, w, bias, 6, 1.5, "sqrtsoftplus")
        got_hash = moe_hash_router.moe_hash_router(x, w, ids, 1.5, "sqrtsoftplus")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = tuple(t.cpu() for t in reference.moe_router(x, w, bias, 6, 1.5, "sqrtsoftplus"))
    reference._compare_routes(got, expected, None, torch.float32)  # the same logits: weights fp32 ulps apart
    torch.testing.assert_close(got_hash, reference.moe_hash_router(x, w, ids, 1.5, "sqrtsoftplus"),
                               atol=1e-5, rtol=1e-5)  # the same logits: only fp32 ulps apart
    weights, chosen = torch.empty_like(got[0]), torch.empty_like(got[1])

    def step():
        new_weights, new_ids = moe_router.moe_router(x, w, bias, 6, 1.5, "sqrtsoftplus")
        weights.copy_(new_weights), chosen.copy_(new_ids)

    backend = CudaBackend()
    with backend.graph_capture(backend.device()) as capture:
        replay = capture(step)
    x.copy_(tokens())
    replay()
    torch.cuda.synchronize()
    eager = moe_router.moe_router(x, w, bias, 6, 1.5, "sqrtsoftplus")
    assert torch.equal(weights, eager[0]) and torch.equal(chosen, eager[1])


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax"])
def test_gpu_router_kernel_rows_do_not_depend_on_the_batch(score_func):
    """The kernel on fixed logits (the GEMM before it is cuBLAS's, which is not batch-invariant): any row alone
    gives the bits it has in a 1000-token batch."""
    from deepinfer_cuda.kernel_set.dispatch import cuda_target

    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(1000, 256, device="cuda", generator=gen).bfloat16()
    bias = 0.1 * torch.randn(256, device="cuda", generator=gen)
    index, arch = cuda_target(logits)

    def route(rows):
        return moe_router.plan_routes(rows, bias, None, 6, 1.5, score_func, arch=arch,
                                      interpreted=False).run(moe_router.KERNEL, index)

    batch = route(logits)
    for row in (0, 1, 7, 500, 999):
        alone = route(logits[row:row + 1].clone())
        assert torch.equal(alone[0], batch[0][row:row + 1]) and torch.equal(alone[1], batch[1][row:row + 1])

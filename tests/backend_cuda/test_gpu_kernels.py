"""On the GPU: every overridden op against core's reference, and the AOT cubin path against Triton JIT.

Skipped on CPU-only machines (CI); run on the GPU host with ``pytest tests/backend_cuda -q``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.testing import check_coverage, check_op, conformance_params, coverage_params
from deepinfer_cuda.plugin import CudaBackend
from tests.support.aot_jit import assert_aot_equals_jit

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host: pytest tests/backend_cuda")
BACKEND = CudaBackend()


def _conformance_cases():
    try:
        return conformance_params(BACKEND)  # (op, dtype) for every op the backend overrides
    except ImportError as exc:  # triton missing: nothing to check, say so
        return [pytest.param("?", None, marks=pytest.mark.skip(reason=f"cannot load the CUDA ops: {exc}"))]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op_name, dtype", _conformance_cases())
def test_conformance(op_name, dtype):
    assert check_op(BACKEND, op_name, dtype) > 0


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op_name, dtype", coverage_params(BACKEND) if HAS_CUDA else [])
def test_shapes_a_kernel_does_not_cover_run_the_reference(op_name, dtype):
    covered, uncovered = check_coverage(BACKEND, op_name, dtype)
    assert covered > 0 and uncovered > 0


@pytest.fixture(scope="module")
def device_kernel_set(tmp_path_factory):
    """A kernel set for this GPU's arch, built by this process's Triton (as build.sh does)."""
    from deepinfer_cuda.kernel_set.build import build_kernel_set
    from deepinfer_cuda.kernel_set.dispatch import device_arch

    arch = device_arch(torch.cuda.current_device())
    out = tmp_path_factory.mktemp("device_kernel_set")
    build_kernel_set(out, [arch])
    return out


def _model_shape_cases():
    """(kernel module, args) at the V4-Flash shapes the kernel set is built for (every one has a cubin)."""
    from deepinfer_cuda.kernels import (
        compress_entries,
        compress_pool,
        hc_post,
        hc_pre,
        indexer_topk,
        rms_norm,
        rms_norm_rope,
        rope,
        sample_tokens,
        sparse_attention,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device="cuda") / 64))
    for dtype in (torch.bfloat16, torch.float32):
        for rows, dim in [(1, 4096), (37, 4096), (256, 512), (3, 16384), (5, 20480), (100, 128), (7, 1280)]:
            x = randn(rows, dim, dtype=dtype)
            yield rms_norm, (x, 1 + 0.1 * randn(dim, dtype=dtype), 1e-6)
            yield rms_norm, (x, None, 1e-6)
        for tokens in (1, 33):
            positions = torch.randint(0, 1 << 20, (tokens,), device="cuda", generator=gen)
            for shape in [(tokens, 64, 512), (tokens, 512), (tokens, 64, 128), (tokens, 128)]:
                for inverse in (False, True):
                    yield rope, (randn(*shape, dtype=dtype), positions, inv_freq, 1.0, inverse)
            latent = randn(tokens, 4160, dtype=dtype)[:, 1024:1536]  # a CSA layer's input projection, sliced
            yield rms_norm_rope, (randn(tokens, 64, 512, dtype=dtype), None, 1e-6, positions, inv_freq, 1.0)
            weight = 1 + 0.1 * randn(512, dtype=torch.float32)
            yield rms_norm_rope, (latent, weight, 1e-6, positions, inv_freq, 1.0)
            for dim in (4096, 5120):
                post = 2 * torch.rand(tokens, 4, device="cuda", generator=gen)
                comb = torch.softmax(randn(tokens, 4, 4, dtype=torch.float32), dim=-1)
                yield hc_post, (randn(tokens, dim, dtype=dtype), randn(tokens, 4, dim, dtype=dtype), post, comb)
                fn = 0.05 * randn(24, 4 * dim, dtype=torch.float32)
                base = 0.5 * randn(24, dtype=torch.float32)
                scale = 1 + 0.1 * randn(3, dtype=torch.float32)
                yield hc_pre, (randn(tokens, 4, dim, dtype=dtype), fn, base, scale, 1e-6, 1e-6, 20)
    # SWA window 128 + top-512 entries, some slots unused; b1 / b33 / b5 run split-K (+ combine), 80 queries one
    # program per (query, head block)
    for tokens, heads in [(1, 64), (33, 64), (5, 128), (80, 64)]:
        indices = torch.randint(0, 900, (tokens, 640), device="cuda", generator=gen)
        indices[torch.rand(tokens, 640, device="cuda", generator=gen) < 0.2] = -1
        sinks = randn(heads, dtype=torch.float32)
        yield sparse_attention, (randn(tokens, heads, 512, dtype=torch.bfloat16), randn(900, 512, dtype=torch.bfloat16),
                                 indices, sinks, 512**-0.5)
    from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp8_e4m3_pack
    from deepinfer_cuda.kernels import sparse_attention_packed

    rings = fp8_e4m3_pack(randn(512, 512, dtype=torch.float32), 32)  # V4.1-Flash's packed state: SWA FP8 rows,
    entries = fp4_e2m1_pack(randn(2000, 512, dtype=torch.float32), 16, "e4m3")  # compressed latents FP4
    for tokens in (1, 33, 80):  # decode: window 128 ring rows + top-512 entries, 64 rope channels rotated back
        indices = torch.cat([torch.randint(0, 512, (tokens, 128), device="cuda", generator=gen),
                             512 + torch.randint(0, 2000, (tokens, 512), device="cuda", generator=gen)], dim=1)
        indices[torch.rand(tokens, 640, device="cuda", generator=gen) < 0.1] = -1
        positions = torch.randint(0, 1 << 20, (tokens,), device="cuda", generator=gen)
        yield sparse_attention_packed, (randn(tokens, 64, 512, dtype=torch.bfloat16), rings, entries, 512, indices,
                                        randn(64, dtype=torch.float32), 512**-0.5, positions, inv_freq, 1.0, 32, 16,
                                        "e4m3")
    for tokens, seqs, entries in [(1, 1, 300), (64, 2, 1000)]:  # 64 index heads x 128, top-512
        seq_ids = torch.sort(torch.randint(0, seqs, (tokens,), device="cuda", generator=gen)).values
        limits = torch.randint(0, entries + 1, (tokens,), device="cuda", generator=gen)
        yield indexer_topk, (randn(tokens, 64, 128, dtype=torch.bfloat16), randn(tokens, 64, dtype=torch.bfloat16),
                             randn(seqs, entries, 128, dtype=torch.bfloat16), seq_ids, limits, 512, 128**-0.5,
                             64**-0.5)
    from deepinfer_cuda.kernels import indexer_topk_packed

    key_pages = fp4_e2m1_pack(randn(5000, 128, dtype=torch.float32), 32, "ue8m0")  # V4.1-Flash: 68 B a key
    for tokens, seqs, entries in [(1, 1, 300), (64, 2, 1000)]:  # 32 index heads x 128, top-512, rows scattered
        seq_ids = torch.sort(torch.randint(0, seqs, (tokens,), device="cuda", generator=gen)).values
        limits = torch.randint(0, entries + 1, (tokens,), device="cuda", generator=gen)
        key_rows = torch.randperm(5000, device="cuda", generator=gen)[: seqs * entries].view(seqs, entries)
        q, w = randn(tokens, 32, 128, dtype=torch.bfloat16), randn(tokens, 32, dtype=torch.bfloat16)
        yield indexer_topk_packed, (q, w, key_pages, key_rows, 32, "ue8m0", seq_ids, limits, 512, 128**-0.5,
                                    32**-0.5)
    for dtype in (torch.bfloat16, torch.float32):  # CSA (2 x ratio 4 slots) and HCA (128) at head / index dims
        for windows, slots, dim in [(1, 8, 512), (300, 8, 512), (17, 128, 512), (64, 8, 128), (5, 4, 512)]:
            score = randn(windows, slots, dim, dtype=torch.float32)
            score[0, : slots // 2] = float("-inf")  # CSA's first window: no previous series
            yield compress_pool, (randn(windows, slots, dim, dtype=dtype), score)
    for dtype in (torch.bfloat16, torch.float32):  # compressor entries: CSA / indexer (overlap) and HCA, rope dim 64
        for windows, ratio, dim, overlap in [(1, 4, 512, True), (300, 4, 512, True), (64, 4, 128, True),
                                             (17, 128, 512, False)]:
            width = 2 * dim if overlap else dim
            previous = randn(windows, ratio, 2 * dim, dtype=dtype) if overlap else None
            has_previous = torch.arange(windows, device="cuda") % 5 != 0 if overlap and windows > 1 else None
            positions = ratio * torch.randint(0, 1 << 18, (windows,), device="cuda", generator=gen)
            yield compress_entries, (randn(windows, ratio, 2 * width, dtype=dtype), previous, has_previous,
                                     randn(ratio, width, dtype=torch.float32),
                                     1 + 0.1 * randn(dim, dtype=torch.float32), 1e-6, positions, inv_freq, 1.0)
    for rows in (1, 64):  # V4's vocabulary: 32 chunks per row, the last partial; greedy and seeded rows
        greedy = torch.arange(rows, device="cuda") % 4 == 3
        seeds = torch.randint(-2**62, 2**62, (rows,), device="cuda", generator=gen)
        steps = torch.randint(0, 5000, (rows,), device="cuda", generator=gen)
        yield sample_tokens, (3 * randn(rows, 129280, dtype=torch.float32), greedy, seeds, steps)
    from deepinfer_cuda.kernels import verify_drafts

    for rows in (1, 64):  # a speculative step: 4 drafts over V4's vocabulary, from a blurred target
        target = 3 * randn(rows, 5, 129280, dtype=torch.float32)
        q = torch.softmax(target[:, :4] + randn(rows, 4, 129280, dtype=torch.float32), dim=-1)
        drafts = torch.multinomial(q.view(-1, 129280), 1, generator=gen).view(rows, 4)
        num = torch.randint(0, 5, (rows,), device="cuda", generator=gen)
        num[0] = 4
        greedy = torch.arange(rows, device="cuda") % 4 == 3
        seeds = torch.randint(-2**62, 2**62, (rows,), device="cuda", generator=gen)
        steps = torch.randint(0, 5000, (rows,), device="cuda", generator=gen)
        yield verify_drafts, (target, greedy, drafts, num, seeds, steps)
    # MoE routers at the slice's 64, V4-Flash's 256 and V4.1's 384 experts.  Small integers in x and multiples of
    # 1/512 in w make every logit exact in fp32 whatever the GEMM's order (cuBLAS here, the CPU in the reference), so
    # the expert sets must agree; the fp32 correction bias breaks the ties that bf16 logits have.
    from deepinfer_cuda.kernels import moe_hash_router, moe_router

    for dtype in (torch.bfloat16, torch.float32):
        for tokens, experts in [(1, 64), (33, 256), (1024, 256), (5, 384)]:
            x = torch.randint(-2, 3, (tokens, 4096), device="cuda", generator=gen).to(dtype)
            w = (torch.randint(-2, 3, (experts, 4096), device="cuda", generator=gen) / 512).to(dtype)
            bias = 0.1 * randn(experts, dtype=torch.float32)
            ids = torch.randint(0, experts, (tokens, 6), device="cuda", generator=gen)
            yield moe_router, (x, w, bias, 6, 1.5, "sqrtsoftplus")
            yield moe_router, (x, w, bias, 8, 1.0, "softmax")
            yield moe_hash_router, (x, w, ids, 1.5, "sqrtsoftplus")


def _op_name(module) -> str:
    """The core op a kernel module overrides: its kernel's name, else the module's (``verify_drafts`` has no kernel
    of its own: it launches ``sample_tokens``')."""
    kernel = getattr(module, "KERNEL", None)
    return kernel.name if kernel is not None else module.__name__.rsplit(".", 1)[1]


def _call(module, args):
    return getattr(module, _op_name(module))(*args)


@requires_cuda
@pytest.mark.cuda
def test_aot_cubin_equals_jit_bitwise(device_kernel_set):
    from deepinfer_cuda.ops import aot_kernels

    assert_aot_equals_jit(device_kernel_set, aot_kernels(), list(_model_shape_cases()), _call,
                          restore=device_kernel_set, name=_op_name, jit_relaunches_all=True)


@requires_cuda
@pytest.mark.cuda
def test_kernels_match_reference_at_model_shapes():
    # Conformance samples are small; this checks the V4-Flash shapes (e.g. positions up to 2^20 for RoPE).
    from deepinfer.ops import OpSample, op_defs
    from deepinfer.testing import assert_close

    defs = op_defs()
    for module, args in _model_shape_cases():
        op = defs[_op_name(module)]
        dtype = args[0].dtype
        cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        expected = op.reference(*cpu_args)
        if op.compare is not None:  # e.g. indexer_topk: which of two tied entries is kept is free
            op.compare(_call(module, args), expected, OpSample(cpu_args), dtype)
            continue
        assert_close(_call(module, args), expected, dtype, op.tolerances[dtype], f"{op.name} {tuple(args[0].shape)}")


@requires_cuda
@pytest.mark.cuda
def test_unmatched_specialization_falls_back_to_jit_and_is_right(device_kernel_set):
    from deepinfer.ops.norm import rms_norm as reference
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set
    from deepinfer_cuda.kernels.rms_norm import KERNEL, rms_norm

    use_kernel_set(device_kernel_set)
    base = torch.randn(4 * 4096 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(4, 4096)  # 2-byte offset: no aligned cubin applies
    y = rms_norm(x, None, 1e-6)
    assert KERNEL.launch_counts == {"cubin": 0, "jit": 1}
    torch.testing.assert_close(y.float().cpu(), reference(x.cpu(), None, 1e-6).float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.cuda
def test_cubin_launch_is_captured_by_cuda_graphs(device_kernel_set):
    # The cubin launcher must enqueue on torch's current stream, so graph capture records it.
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set
    from deepinfer_cuda.kernels.rms_norm import KERNEL, rms_norm

    use_kernel_set(device_kernel_set)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    with BACKEND.graph_capture(BACKEND.device()) as capture:
        replay = capture(lambda: out.copy_(rms_norm(x, w, 1e-6)))
    assert KERNEL.launch_counts["cubin"] >= 2 and KERNEL.launch_counts["jit"] == 0
    x.copy_(torch.randn_like(x))
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), atol=0, rtol=0)


def test_gpu_tests_skip_with_a_reason_on_cpu():
    # Guard against the GPU tests silently passing on CPU: without CUDA they must be marked skipped.
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    assert requires_cuda.args[0] is True and "GPU" in requires_cuda.kwargs["reason"]

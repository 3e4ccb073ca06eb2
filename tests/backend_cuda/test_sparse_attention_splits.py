"""Split-K sparse attention: the split and whole regimes give the same bits, and -1 padding changes nothing.

The kernel cuts a query's index columns into fixed splits of ``split_n``; decode runs one program per split plus a
combine kernel, larger batches one program per query that merges its splits in registers.  These tests check the
properties batch invariance rests on: both regimes are bitwise equal; a row padded with -1 (whole splits of
padding, a width that is not a multiple of ``split_n``) gives the same bits as the row alone; a query with no valid
index returns zeros; everything agrees with core's reference.  On the CPU under Triton's interpreter (CI), and at
V4 shapes on the GPU host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CHECKS = textwrap.dedent(
    """
    import torch
    from deepinfer.ops import op_defs
    from deepinfer.testing.conformance import assert_close
    from deepinfer_cuda.arch import sparse_attention_config
    from deepinfer_cuda.kernels import sparse_attention as module

    from deepinfer_cuda.kernels import rope as rope_module

    OP = op_defs()["sparse_attention"]
    ROPE_OP = op_defs()["sparse_attention_inverse_rope"]


    def attend(q, kv, idx, sinks, split, rope=()):
        plan = module.prepare(q, kv, idx, sinks, q.shape[-1] ** -0.5, *rope, arch=ARCH, split=split)
        assert len(plan.steps) == (2 if split and idx.shape[1] > SPLIT_N else 1)
        return RUN(plan)


    def check_inverse_rope(q, kv, idx, sinks, plain, gen):
        # the epilogue rotation: both regimes give the bits of the rope kernel run on the plain output
        positions = torch.randint(0, 1 << 20, (q.shape[0],), generator=gen).to(q.device)
        inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).to(q.device)
        rope = (positions, inv_freq, 1.25)
        rotated = attend(q, kv, idx, sinks, True, rope)
        assert torch.equal(rotated, attend(q, kv, idx, sinks, False, rope)), "regimes differ with the rotation"
        two_pass = RUN_ONE(rope_module.KERNEL, rope_module.prepare(plain, *rope, inverse=True, arch=ARCH))
        assert torch.equal(rotated, two_pass), "epilogue rotation differs from the rope kernel"
        assert torch.equal(rotated[..., :-64], plain[..., :-64]), "channels before the rope dims changed"
        cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (q, kv, idx, sinks, q.shape[-1] ** -0.5, *rope)]
        assert_close(rotated.cpu(), ROPE_OP.reference(*cpu), q.dtype, ROPE_OP.tolerances[q.dtype], "inverse rope")


    def check(tokens, heads, dim, pool, dtype, gen, device):
        q = torch.randn(tokens, heads, dim, generator=gen).to(dtype).to(device)
        kv = torch.randn(pool, dim, generator=gen).to(dtype).to(device)
        sinks = torch.randn(heads, generator=gen).to(device)
        # Rows of different lengths, none a multiple of SPLIT_N; -1 holes; row 1 has a split of -1 in its middle
        # (columns SPLIT_N..2*SPLIT_N-1) and valid columns after it; the last row has no valid index.
        lengths = [150, 3 * SPLIT_N + 7, 70, 1][:tokens - 1] + [0]
        width = 4 * SPLIT_N + 20  # the batch's padded width: whole splits of -1 after the short rows
        idx = torch.full((tokens, width), -1, dtype=torch.int64)
        for row, length in enumerate(lengths):
            idx[row, :length] = torch.randint(0, pool, (length,), generator=gen)
        idx[torch.rand(tokens, width, generator=gen) < 0.2] = -1
        idx[1, SPLIT_N:2 * SPLIT_N] = -1
        idx = idx.to(device)

        split = attend(q, kv, idx, sinks, True)
        whole = attend(q, kv, idx, sinks, False)
        assert torch.equal(split, whole), "split-K and one program per query differ"
        assert not torch.isnan(split).any()
        assert torch.equal(split[tokens - 1], torch.zeros_like(split[tokens - 1])), "no valid index must give zeros"
        for row, length in enumerate(lengths):  # each row alone, at its own width: the same bits
            own = idx[row:row + 1, :max(length, 1)]
            for regime in (True, False):
                alone = attend(q[row:row + 1], kv, own, sinks, regime)
                assert torch.equal(alone[0], split[row]), f"row {row} (length {length}) depends on the batch"
        cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (q, kv, idx, sinks, dim ** -0.5)]
        assert_close(split.cpu(), OP.reference(*cpu), dtype, OP.tolerances[dtype], f"{tokens}x{heads}x{dim}")
        if dim >= 128:
            check_inverse_rope(q, kv, idx, sinks, split, gen)
        return 1
    """
)

INTERPRETER_SCRIPT = CHECKS + textwrap.dedent(
    """
    from deepinfer_cuda.arch import SM90A

    import types
    import triton.language as tl

    torch.set_num_threads(1)
    module.INTERPRETED = True
    for m in (module, rope_module):  # libdevice has no interpreter implementation
        m.libdevice = types.SimpleNamespace(cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x))
    ARCH = SM90A


    def RUN_ONE(kernel, launch):
        if all(g > 0 for g in launch.grid):
            kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                       num_stages=launch.config.num_stages)
        return launch.result


    def RUN(plan):
        for kernel, launch in plan.steps:
            RUN_ONE(kernel, launch)
        return plan.finish()


    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        SPLIT_N = sparse_attention_config(ARCH, 40, 64, torch.tensor([], dtype=dtype).element_size()).split_n
        gen = torch.Generator().manual_seed(0)
        checked += check(5, 40, 64, 300, dtype, gen, "cpu")  # 40 heads: a full and a partly masked head block
        checked += check(3, 16, 512, 200, dtype, gen, "cpu")  # V4's head_dim
    print("CHECKED", checked)
    """
)


# slow: minutes under the interpreter on 2 cores; test_kernels_interpreted covers the kernel's default regime.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_split_regimes_on_gpu checks the kernel")
def test_split_regimes_agree_bitwise_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "CHECKED 4" in proc.stdout, proc.stdout


def test_split_plan_depends_on_shapes_not_on_the_batch():
    # prepare() needs no GPU: the plan (grids, split size) is checked on CPU tensors.
    from deepinfer_cuda.arch import SM90A, sparse_attention_config
    from deepinfer_cuda.kernels.sparse_attention import COMBINE_KERNEL, KERNEL, prepare

    tiles = sparse_attention_config(SM90A, 64, 512, 2)
    assert tiles.split_n % tiles.block_n == 0

    def plan(tokens, width):
        q = torch.zeros(tokens, 64, 512, dtype=torch.bfloat16)
        idx = torch.zeros(tokens, width, dtype=torch.int64)
        return prepare(q, torch.zeros(10, 512, dtype=torch.bfloat16), idx, torch.zeros(64), 0.1, arch=SM90A)

    b1 = plan(1, 640)  # V4 CSA decode: 128 window + 512 top-k = 10 splits x 2 head blocks
    assert [k for k, _ in b1.steps] == [KERNEL, COMBINE_KERNEL]
    assert b1.steps[0][1].grid == (1, 2, 640 // tiles.split_n) and b1.steps[1][1].grid == (1, 64)
    assert b1.steps[0][1].args["partial"] == 1 and b1.steps[0][1].args["n_splits"] == 10
    odd = plan(3, 130)  # a width that is not a multiple of split_n: a last, partial split
    assert odd.steps[0][1].grid == (3, 2, 3)
    prefill = plan(1024, 640)  # enough programs without splitting: one per (query, head block), no workspace
    assert [k for k, _ in prefill.steps] == [KERNEL]
    assert prefill.steps[0][1].grid == (1024, 2, 1) and prefill.steps[0][1].args["partial"] == 0
    assert prefill.steps[0][1].args["ws_acc_ptr"].numel() == 1
    # The split size and the compiled variant (constexprs) are the same for every batch size and width.
    keys = {k: v for k, v in b1.steps[0][1].args.items() if not isinstance(v, torch.Tensor)}
    other = {k: v for k, v in prefill.steps[0][1].args.items() if not isinstance(v, torch.Tensor)}
    assert {k: v for k, v in keys.items() if k not in ("n_splits", "partial", "width")} == \
        {k: v for k, v in other.items() if k not in ("n_splits", "partial", "width")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")
@pytest.mark.cuda
def test_split_regimes_on_gpu():
    from deepinfer_cuda.kernel_set.dispatch import cuda_target

    namespace: dict[str, object] = {}
    exec(CHECKS, namespace)  # noqa: S102 - the same checks as the interpreter test, on the compiled kernels
    index, arch = cuda_target(torch.empty(1, device="cuda"))
    namespace["ARCH"] = arch
    namespace["RUN"] = lambda plan: plan.run(index)
    namespace["RUN_ONE"] = lambda kernel, launch: launch.run(kernel, index)
    namespace["SPLIT_N"] = namespace["sparse_attention_config"](arch, 64, 512, 2).split_n
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        assert namespace["check"](5, 64, 512, 4000, dtype, gen, "cuda") == 1  # V4: 64 heads x 512
        assert namespace["check"](4, 128, 512, 900, dtype, gen, "cuda") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")
@pytest.mark.cuda
def test_split_k_decode_is_captured_by_cuda_graphs_without_host_syncs():
    from deepinfer_cuda.kernels.sparse_attention import sparse_attention
    from deepinfer_cuda.plugin import CudaBackend

    backend = CudaBackend()
    q = torch.randn(1, 64, 512, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 1024, (1, 640), device="cuda")
    sinks = torch.randn(64, device="cuda")
    out = torch.empty_like(q)
    sparse_attention(q, kv, idx, sinks, 512**-0.5)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        with backend.graph_capture(backend.device()) as capture:
            replay = capture(lambda: out.copy_(sparse_attention(q, kv, idx, sinks, 512**-0.5)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    q.copy_(torch.randn_like(q))
    idx[0, 300:] = -1
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, sparse_attention(q, kv, idx, sinks, 512**-0.5))


def test_runtime_keys_of_both_kernels_have_an_aot_variant():
    # Decode (split + combine) and larger batches (one program per query) must find cubins at the model shapes.
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels.sparse_attention import prepare

    launched = set()
    inv_freq = torch.rand(32)  # V4: 64 rope channels rotated back in the epilogue (sparse_attention_inverse_rope)
    for heads in (64, 128):
        for tokens, width in [(1, 640), (1, 130), (33, 640), (80, 640), (1024, 640), (2, 4), (3, 8320)]:
            for rope in ((), (torch.zeros(tokens, dtype=torch.int64), inv_freq, 1.0)):
                q = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16)
                plan = prepare(q, torch.zeros(10, 512, dtype=torch.bfloat16),
                               torch.zeros(tokens, width, dtype=torch.int64), torch.zeros(heads), 512**-0.5, *rope,
                               arch=SM90A)
                for kernel, launch in plan.steps:
                    assert kernel.has_aot_variant(launch, SM90A), (kernel.name, heads, tokens, width, len(rope))
                    launched.add((kernel.name, len(rope)))
    assert launched == {(name, n) for name in ("sparse_attention", "sparse_attention_combine") for n in (0, 3)}

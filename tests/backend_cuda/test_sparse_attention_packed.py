"""Sparse attention over V4.1's packed state (``sparse_attention_packed_inverse_rope``): the kernel decodes each
chunk of packed rows in registers and gives bit for bit what the plain kernel gives over the same rows unpacked
(core's ``unpacked_rows``: what the model attended before), in both split regimes, for chunks of ring rows only,
of entry rows only and of both (a decode step's window columns, its picked entries, a mixed ragged row), and for
a sliding-only layer (no entry rows).  On the CPU under Triton's interpreter (CI), and at V4.1-Flash's shapes on
the GPU host (64 heads x 512, SWA window 128 + top-512 entries), where a CUDA graph also captures it.  That every
decode launch finds a cubin is checked on the CPU.
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
    from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp8_e4m3_pack
    from deepinfer.ops.packed_attention import unpacked_rows
    from deepinfer_cuda.kernels import sparse_attention as plain_module
    from deepinfer_cuda.kernels import sparse_attention_packed as module


    def packed_state(rings, entries, dim, gen, device):
        spread = torch.exp2(torch.randint(-10, 1, (rings + entries, 1), generator=gen))
        x = torch.randn(rings + entries, dim, generator=gen) * spread
        return fp8_e4m3_pack(x[:rings], 32).to(device), fp4_e2m1_pack(x[rings:], 16, "e4m3").to(device)


    def decode_columns(tokens, rings, entries, window, picks, gen):
        # each query: its window (ring rows, -1 where the window is not full yet), then its picks (entry rows)
        cols = torch.randint(0, rings, (tokens, window), generator=gen)
        cols[torch.arange(window)[None, :] >= torch.randint(1, window + 1, (tokens, 1), generator=gen)] = -1
        if not picks:
            return cols
        chosen = rings + torch.randint(0, entries, (tokens, picks), generator=gen)
        chosen[torch.rand(tokens, picks, generator=gen) < 0.1] = -1
        return torch.cat([cols, chosen], dim=1)


    def check(tokens, heads, dim, rings, entries, window, picks, dtype, gen, device):
        ring_rows, entry_rows = packed_state(rings, entries, dim, gen, device)
        q = torch.randn(tokens, heads, dim, generator=gen).to(dtype).to(device)
        sinks = torch.randn(heads, generator=gen).to(device)
        positions = torch.randint(0, 1 << 20, (tokens,), generator=gen).to(device)
        inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))).to(device)
        layouts = [decode_columns(tokens, rings, entries, window, picks, gen)]
        if entries:  # a ragged row: ring and entry rows mixed inside every chunk
            mixed = torch.randint(0, rings + entries, (tokens, window + picks), generator=gen)
            mixed[torch.rand(mixed.shape, generator=gen) < 0.3] = -1
            layouts.append(mixed)
        checked = 0
        for cols in layouts:
            cols = cols.to(device)
            args = (q, ring_rows, entry_rows, rings, cols, sinks, dim ** -0.5, positions, inv_freq, 1.0, 32, 16, "e4m3")
            pool, ids = unpacked_rows(ring_rows, entry_rows, rings, cols, 32, 16, "e4m3", dtype)
            for split in (True, False):
                got = RUN(module.prepare(*args, arch=ARCH, split=split))
                plain = RUN(plain_module.prepare(q, pool, ids, sinks, dim ** -0.5, positions, inv_freq, 1.0, arch=ARCH,
                                                 split=split))
                assert torch.equal(got, plain), f"packed and unpacked rows differ (split={split}, {tuple(cols.shape)})"
                assert not torch.isnan(got).any()
                checked += 1
        return checked
    """
)

INTERPRETER_SCRIPT = CHECKS + textwrap.dedent(
    """
    import types

    import triton.language as tl

    from deepinfer_cuda.arch import SM90A

    torch.set_num_threads(1)
    module.INTERPRETED = plain_module.INTERPRETED = True
    plain_module.libdevice = types.SimpleNamespace(cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x))
    ARCH = SM90A


    def RUN(plan):
        for kernel, launch in plan.steps:
            kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                       num_stages=launch.config.num_stages)
        return plan.finish()


    checked = 0
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        checked += check(2, 16, 64, 40, 30, 64, 64, dtype, gen, "cpu")  # window chunk, then entry chunks
        checked += check(2, 16, 64, 40, 0, 64, 0, dtype, gen, "cpu")  # a sliding-only layer
    print("CHECKED", checked)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_packed_rows_on_gpu checks the kernel")
def test_packed_rows_attend_as_the_unpacked_rows_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "CHECKED 12" in proc.stdout, proc.stdout


def test_v41_flash_decode_launches_have_aot_variants():
    """Decode at V4.1-Flash's shapes (64 heads x 512, 64 rope channels): window only (128 columns) and window +
    top-512 entries, split (few queries) and whole (many); the packed kernel and the split combine."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels.sparse_attention_packed import prepare

    launched = set()
    for heads in (64, 128):
        for tokens, width in [(1, 128), (1, 640), (8, 640), (33, 640), (80, 640), (256, 128)]:
            q = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16)
            rings, entries = torch.zeros(300, 528, dtype=torch.uint8), torch.zeros(100, 288, dtype=torch.uint8)
            plan = prepare(q, rings, entries, 300, torch.zeros(tokens, width, dtype=torch.int64), torch.zeros(heads),
                           512**-0.5, torch.zeros(tokens, dtype=torch.int64), torch.rand(32), 1.0, 32, 16, "e4m3",
                           arch=SM90A)
            for kernel, launch in plan.steps:
                assert kernel.has_aot_variant(launch, SM90A), (kernel.name, heads, tokens, width)
                launched.add(kernel.name)
    assert launched == {"sparse_attention_packed_inverse_rope", "sparse_attention_combine"}


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")


@requires_cuda
@pytest.mark.cuda
def test_packed_rows_on_gpu():
    from deepinfer_cuda.kernel_set.dispatch import cuda_target

    namespace: dict[str, object] = {}
    exec(CHECKS, namespace)  # noqa: S102 - the interpreter test's checks, on the compiled kernels
    index, arch = cuda_target(torch.empty(1, device="cuda"))
    namespace["ARCH"] = arch
    namespace["RUN"] = lambda plan: plan.run(index)
    check = namespace["check"]
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 33, 80):  # V4.1-Flash: window 128 + top-512 entries; a sliding-only layer
            assert check(tokens, 64, 512, 4 * 128, 3000, 128, 512, dtype, gen, "cuda") == 4
            assert check(tokens, 64, 512, 4 * 128, 0, 128, 0, dtype, gen, "cuda") == 2


@requires_cuda
@pytest.mark.cuda
def test_packed_decode_is_captured_by_cuda_graphs_without_host_syncs():
    from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp8_e4m3_pack
    from deepinfer_cuda.kernels.sparse_attention_packed import sparse_attention_packed_inverse_rope as attend
    from deepinfer_cuda.plugin import CudaBackend

    backend = CudaBackend()
    q = torch.randn(1, 64, 512, device="cuda", dtype=torch.bfloat16)
    rings = fp8_e4m3_pack(torch.randn(256, 512, device="cuda"), 32)
    entries = fp4_e2m1_pack(torch.randn(1024, 512, device="cuda"), 16, "e4m3")
    idx = torch.cat([torch.randint(0, 256, (1, 128)), 256 + torch.randint(0, 1024, (1, 512))], dim=1).cuda()
    sinks, positions = torch.randn(64, device="cuda"), torch.tensor([1000], device="cuda")
    inv_freq = torch.rand(32, device="cuda")

    def call():
        return attend(q, rings, entries, 256, idx, sinks, 512**-0.5, positions, inv_freq, 1.0, 32, 16, "e4m3")

    out = torch.empty_like(q)
    call()  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        with backend.graph_capture(backend.device()) as capture:
            replay = capture(lambda: out.copy_(call()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    q.copy_(torch.randn_like(q))
    idx[0, 600:] = -1
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call())

"""The lightning indexer over V4.1's packed FP4 keys (``indexer_*_packed``): the scores kernel decodes each entry's
page row in registers and gives bit for bit the scores the plain kernel gives over the same keys unpacked (core's
``unpacked_keys``: what the model scored before), with and without the candidate-block mask, with rows scattered
over the pages and rows of -1 past every query's limit (a page table's padding).  On the CPU under Triton's
interpreter (CI), and at V4.1-Flash's shapes (32 index heads x 128) on the GPU host: fp32 bit for bit; bf16 to the
last bits of fp32, since the compiled kernels feed the tensor cores the decoded keys from registers and the plain
keys from shared memory, which sum in other orders (H200: up to 1e-6 apart in 776 of 192,000 scores; the model's
logits with packed state still equal the bf16 state's, ``test_e2e_released_gpu.py``).  That every decode launch
finds a cubin is checked on the CPU.
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
    from deepinfer.ops.kv_quant import fp4_e2m1_pack
    from deepinfer.ops.packed_indexer import unpacked_keys
    from deepinfer_cuda.kernels.indexer_topk import PackedKeys, plan_scores
    from deepinfer_cuda.kernels.indexer_topk_in_blocks import allowed_blocks


    def check(tokens, heads, dim, seqs, entries, block, fmt, dtype, gen, device):
        pages_count = seqs * entries + 7
        rows = torch.randperm(pages_count, generator=gen)[: seqs * entries].view(seqs, entries)
        limits = torch.randint(1, entries + 1, (tokens,), generator=gen)
        seq_ids = torch.sort(torch.randint(0, seqs, (tokens,), generator=gen)).values
        longest = torch.zeros(seqs, dtype=torch.int64).scatter_reduce(0, seq_ids, limits, "amax")
        rows[torch.arange(entries)[None, :] >= longest[:, None]] = -1  # no query reaches these: a table's padding
        spread = torch.exp2(torch.randint(-8, 3, (pages_count, 1), generator=gen))
        pages = fp4_e2m1_pack(torch.randn(pages_count, dim, generator=gen) * spread, block, fmt)
        q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        w = torch.randn(tokens, heads, generator=gen).to(dtype)
        blocks = torch.randint(-1, entries // 4 + 1, (tokens, 3), generator=gen)
        moved = (t.to(device) for t in (pages, rows, q, w, seq_ids, limits, blocks))
        pages, rows, q, w, seq_ids, limits, blocks = moved
        keys = unpacked_keys(pages, rows.clamp(min=0), block, fmt, dtype)
        checked = 0
        for masked in (False, True):
            extra = dict(allowed=allowed_blocks(blocks, entries, 4), candidate_block=4) if masked else {}
            common = (seq_ids, limits, dim ** -0.5, heads ** -0.5)
            got = RUN(plan_scores(q, w, PackedKeys(pages, rows, block, fmt), *common, arch=ARCH,
                                  interpreted=INTERPRETED, **extra))
            plain = RUN(plan_scores(q, w, keys, *common, arch=ARCH, interpreted=INTERPRETED, **extra))
            if device == "cuda" and dtype == torch.bfloat16:  # tensor-core operands from registers vs shared memory
                torch.testing.assert_close(got, plain, rtol=1e-5, atol=2e-6)
            else:
                assert torch.equal(got, plain), f"packed and unpacked keys score differently (masked={masked})"
            assert bool((got.isfinite() | (got == float("-inf"))).all())
            checked += 1
        return checked
    """
)

INTERPRETER_SCRIPT = CHECKS + textwrap.dedent(
    """
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels.indexer_topk import KERNEL

    torch.set_num_threads(1)
    ARCH, INTERPRETED = SM90A, True


    def RUN(launch):
        KERNEL.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                   num_stages=launch.config.num_stages)
        return launch.result


    checked = 0
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        checked += check(5, 16, 64, 2, 70, 32, "ue8m0", dtype, gen, "cpu")  # V4.1's key format
        checked += check(3, 8, 32, 3, 20, 16, "e4m3", dtype, gen, "cpu")
    print("CHECKED", checked)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_packed_keys_on_gpu checks the kernel")
def test_packed_keys_score_as_the_unpacked_keys_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "CHECKED 8" in proc.stdout, proc.stdout


def test_v41_flash_decode_launches_have_aot_variants():
    """V4.1-Flash's index sources at decode: 32 heads x 128, keys FP4 + ue8m0 per 32 (68 B), with and without the
    candidate blocks (8 entries a block)."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import indexer_candidates_packed, indexer_topk_in_blocks_packed, indexer_topk_packed

    for tokens, seqs, entries in [(1, 1, 2048), (32, 32, 4096)]:
        q = torch.zeros(tokens, 32, 128, dtype=torch.bfloat16)
        w = torch.zeros(tokens, 32, dtype=torch.bfloat16)
        pages, rows = torch.zeros(5000, 68, dtype=torch.uint8), torch.zeros(seqs, entries, dtype=torch.int64)
        limits = torch.full((tokens,), entries)
        # the sequence ids 16-byte aligned, or 8 bytes into a buffer (a decode step's plan holds them so)
        for seq_ids in (torch.arange(tokens) % seqs, (torch.arange(tokens + 1) % seqs)[1:]):
            args = (q, w, pages, rows, 32, "ue8m0", seq_ids, limits, 512, 128**-0.5, 32**-0.5)
            blocks = torch.zeros(tokens, 64, dtype=torch.int64)
            for module, extra in [(indexer_topk_packed, ()), (indexer_candidates_packed, (8, 64)),
                                  (indexer_topk_in_blocks_packed, (blocks, 8))]:
                for kernel, launch in module.prepare(*args, *extra, arch=SM90A).steps:
                    assert kernel.has_aot_variant(launch, SM90A), (module.__name__, tokens, seq_ids.data_ptr() % 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")
@pytest.mark.cuda
def test_packed_keys_on_gpu():
    from deepinfer_cuda.kernel_set.dispatch import cuda_target
    from deepinfer_cuda.kernels.indexer_topk import KERNEL

    namespace: dict[str, object] = {}
    exec(CHECKS, namespace)  # noqa: S102 - the interpreter test's checks, on the compiled kernels
    index, arch = cuda_target(torch.empty(1, device="cuda"))
    namespace.update(ARCH=arch, INTERPRETED=False, RUN=lambda launch: launch.run(KERNEL, index))
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens, seqs in [(1, 1), (64, 8)]:  # V4.1-Flash: 32 index heads x 128, FP4 + ue8m0 per 32
            assert namespace["check"](tokens, 32, 128, seqs, 3000, 32, "ue8m0", dtype, gen, "cuda") == 2

"""The MoE plan above one program's slots (prefill): the three chunked kernels of moe_routing.py.

- under Triton's interpreter, ``order`` and the block table equal the torch oracle (:func:`expert_blocks`) bit
  for bit around the chunk and scatter-tile boundaries (1023, 1024, 1025 slots: the first two forced onto the
  chunked path), at a 1024-token top-6 prefill (6144) and the largest batch (8192 x 6 = 49152), with repeated
  and skewed expert ids and with every slot on one expert, at 64 / 256 / 384 experts and both block sizes;
- the one-program kernel and the chunked kernels give the same tables at a decode size;
- every launch of a prefill-size plan at V4 shapes finds its AOT variant;
- on a GPU, the compiled kernels equal the torch oracle (the interpreter test is skipped there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_routing as routing

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)

    def run(ids, experts, block_m, chunked):
        limit = routing.PLAN_KERNEL_MAX_SLOTS
        routing.PLAN_KERNEL_MAX_SLOTS = 0 if chunked else limit
        try:
            order, blocks, steps = routing.plan(ids, experts, block_m, arch=SM90A)
        finally:
            routing.PLAN_KERNEL_MAX_SLOTS = limit
        want = [routing.COUNT_KERNEL, routing.SCAN_KERNEL, routing.SCATTER_KERNEL] if chunked else [routing.PLAN_KERNEL]
        assert [k for k, _ in steps] == want, steps
        order.fill_(-7), blocks.fill_(-7)  # stale values must not survive
        for kernel, l in steps:
            kernel.jit_fn[l.grid](**l.args, num_warps=l.config.num_warps, num_stages=l.config.num_stages)
        return order, blocks

    def ids_for(kind, slots, experts):
        if kind == "random":  # repeated ids everywhere
            return torch.randint(0, experts, (slots,), generator=gen)
        if kind == "skewed":  # most slots on two experts, runs that cross chunks, the rest spread
            ids = torch.randint(0, experts, (slots,), generator=gen)
            hot = torch.rand(slots, generator=gen) < 0.8
            ids[hot] = torch.where(torch.rand(slots, generator=gen)[hot] < 0.75, experts - 1, 3)
            ids[slots // 3: slots // 3 + 700] = 5
            return ids
        return torch.full((slots,), experts // 2, dtype=torch.int64)  # every slot on one expert

    cases = [(1023, 256, 16, "random", True), (1024, 384, 16, "skewed", True), (1024, 64, 64, "one", True),
             (1025, 256, 16, "skewed", False), (1025, 384, 64, "random", False), (6144, 256, 16, "random", False),
             (6144, 64, 64, "skewed", False), (6144, 384, 16, "one", False), (5000, 7, 4, "random", False),
             (49152, 256, 16, "skewed", False)]
    for slots, experts, block_m, kind, forced in cases:
        ids = ids_for(kind, slots, experts).view(-1, 6) if slots % 6 == 0 else ids_for(kind, slots, experts)
        order, blocks = run(ids, experts, block_m, chunked=True)
        want_order, want_blocks = routing.expert_blocks(ids, experts, block_m)
        assert torch.equal(order, want_order), (slots, experts, kind, (order != want_order).nonzero()[:5])
        assert torch.equal(blocks, want_blocks), (slots, experts, kind, (blocks != want_blocks).nonzero()[:5])
    print("OK chunked")

    ids = torch.randint(0, 64, (100, 6), generator=gen)
    one, chunked = run(ids, 64, 16, chunked=False), run(ids, 64, 16, chunked=True)
    assert torch.equal(one[0], chunked[0]) and torch.equal(one[1], chunked[1])
    print("OK same")
    """
)


# slow: minutes under the interpreter on 2 cores. test_kernels_interpreted runs the routing kernels (one chunk)
# through moe_experts; test_chunked_plan_on_the_gpu runs this on the device.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_chunked_plan_on_the_gpu runs instead")
def test_chunked_plan_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == ["OK", "chunked", "OK", "same"], proc.stdout


def test_prefill_plan_launches_have_an_aot_variant():
    """V4 shapes (64 / 256 / 384 experts, the config's block sizes) up to 8192 tokens at top-6: three launches,
    each one's runtime key among the kernel's AOT variants."""
    from deepinfer_cuda.arch import SM90A, moe_experts_config
    from deepinfer_cuda.kernels import moe_routing as routing

    for hidden, inter, experts in [(4096, 2048, 64), (4096, 2048, 256), (5120, 2304, 384)]:
        for tokens in (171, 1024, 8192):
            block_m = moe_experts_config(SM90A, tokens * 6 // experts, hidden, inter, 2).block_m
            ids = torch.randint(0, experts, (tokens, 6))
            _, _, steps = routing.plan(ids, experts, block_m, arch=SM90A)
            assert [k for k, _ in steps] == [routing.COUNT_KERNEL, routing.SCAN_KERNEL, routing.SCATTER_KERNEL]
            for kernel, launch in steps:
                assert kernel.has_aot_variant(launch, SM90A), (kernel.name, experts, tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_chunked_plan_on_the_gpu():
    """The compiled kernels (JIT) equal the torch oracle at prefill sizes, skewed ids included."""
    from deepinfer_cuda.kernel_set.dispatch import device_arch
    from deepinfer_cuda.kernels import moe_routing as routing

    arch = device_arch(torch.cuda.current_device())
    gen = torch.Generator().manual_seed(1)
    for slots, experts, block_m in [(1025, 256, 16), (6144, 256, 16), (6144, 64, 64), (49152, 384, 16)]:
        for skew in (False, True):
            ids = torch.randint(0, experts, (slots,), generator=gen)
            if skew:
                ids[: slots * 3 // 4] = experts - 1
            ids = ids.cuda()
            order, blocks, steps = routing.plan(ids, experts, block_m, arch=arch)
            assert len(steps) == 3
            for kernel, launch in steps:
                launch.run(kernel, torch.cuda.current_device())
            want_order, want_blocks = routing.expert_blocks(ids, experts, block_m)
            assert torch.equal(order, want_order), (slots, experts, skew)
            assert torch.equal(blocks, want_blocks), (slots, experts, skew)

"""The MoE experts' decode path on the CPU: the one-program plan kernel, the k-way combine kernel and the
small-batch tiles, under Triton's interpreter (the conformance samples reach neither the tiles of the
fewer-slots-than-experts tier nor the plan's edge cases); and the keys of model-shape calls, which must be
compiled ahead of time.

- the plan kernel's ``order`` and block table equal the torch plan's (:func:`expert_blocks`) bit for bit,
  repeated experts, 1..1024 slots and 4..384 experts included;
- the combine kernel adds each token's k slot outputs in the reference's order and rounding, bit for bit;
- the op through the plan kernel equals the op through the chunked (prefill) plan bit for bit; with the narrow
  decode tiles
  and with the b16 tiles it is as close to core's reference as the conformance tolerances ask (the interpreter's
  numpy dot sums in a shape-dependent order, so the two tiers are not compared bit for bit here).
"""

from __future__ import annotations

import itertools
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
    from deepinfer.ops.moe import moe_experts as reference
    from deepinfer.ops import op_defs
    from deepinfer.testing.conformance import assert_close
    from deepinfer_cuda.arch import SM90A, moe_experts_config
    from deepinfer_cuda.kernels import moe_experts as moe, moe_routing as routing

    torch.set_num_threads(1)
    moe.INTERPRETED = True
    gen = torch.Generator().manual_seed(0)

    def launch(kernel, l):
        if all(g > 0 for g in l.grid):
            kernel.jit_fn[l.grid](**l.args, num_warps=l.config.num_warps, num_stages=l.config.num_stages)

    def run(plan):
        for kernel, l in plan.steps:
            launch(kernel, l)
        return plan.finish()

    def route(tokens, top_k, experts, repeat=True):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        if repeat and tokens > 1 and top_k > 1:
            ids[1, 1] = ids[1, 0]  # a repeated expert counts twice
        return ids

    # 1. plan kernel == torch plan
    for tokens, top_k, experts, block_m in [(1, 6, 64, 16), (1, 1, 4, 16), (3, 2, 4, 16), (8, 6, 64, 16),
                                            (40, 6, 16, 16), (170, 6, 256, 16), (2, 6, 384, 16), (9, 3, 8, 4)]:
        ids = route(tokens, top_k, experts)
        order, blocks, [(kernel, l)] = routing.plan(ids, experts, block_m, arch=SM90A)
        launch(kernel, l)
        want_order, want_blocks = routing.expert_blocks(ids, experts, block_m)
        assert torch.equal(order, want_order), (tokens, top_k, experts, order, want_order)
        assert torch.equal(blocks, want_blocks), (tokens, top_k, experts, blocks, want_blocks)
    print("OK plan")

    # 2. combine == the reference's k-way sum (stable by expert id, in the model dtype)
    for tokens, top_k, hidden in [(3, 6, 96), (2, 1, 32), (4, 3, 2048)]:
        ids = route(tokens, top_k, 8)
        slot_out = (100 * torch.randn(tokens * top_k, hidden, generator=gen)).bfloat16()
        out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
        config, block_h = moe.moe_combine_config(SM90A, hidden)
        l = moe.Launch((tokens, -(-hidden // block_h)), config, dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out,
                       **moe._combine_constexprs(hidden, top_k, block_h)), out)
        launch(moe.COMBINE_KERNEL, l)
        per_slot = slot_out.view(tokens, top_k, hidden)
        want = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        for j in torch.sort(ids, dim=1, stable=True).indices.T:
            want = want + per_slot[torch.arange(tokens), j]
        assert torch.equal(out, want), (tokens, top_k, hidden)
    print("OK combine")

    # 3. the op: plan kernel vs torch plan, narrow decode tiles vs b16 tiles, and against the reference
    tol = op_defs()["moe_experts"].tolerances
    for tokens, hidden, inter, experts, top_k, dtype in [(1, 64, 32, 8, 2, torch.bfloat16),
                                                         (3, 128, 64, 32, 6, torch.bfloat16),
                                                         (2, 64, 48, 16, 3, torch.float32)]:
        x = (3 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
        ids = route(tokens, top_k, experts)
        w = torch.rand(tokens, top_k, generator=gen)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5 * 4).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        args = (x, ids, w, w13, w2, 10.0)
        narrow = moe_experts_config(SM90A, 0, hidden, inter, x.element_size())
        wide = moe_experts_config(SM90A, 1, hidden, inter, x.element_size())
        assert tokens * top_k < experts and narrow != wide
        plan = moe.prepare(*args, arch=SM90A)
        assert plan.steps[0][0] is routing.PLAN_KERNEL and len(plan.steps) == 4
        ours = run(plan)
        assert_close(ours, reference(*args), dtype, tol[dtype], f"moe_experts {tokens}x{hidden} E={experts}")
        expected = reference(*args)
        assert_close(run(moe.prepare(*args, arch=SM90A, tiles=wide)), expected, dtype, tol[dtype], "b16 tiles")
        limit, routing.PLAN_KERNEL_MAX_SLOTS = routing.PLAN_KERNEL_MAX_SLOTS, 0
        try:
            by_chunks = moe.prepare(*args, arch=SM90A)  # the prefill plan: three chunked kernels
        finally:
            routing.PLAN_KERNEL_MAX_SLOTS = limit
        assert len(by_chunks.steps) == 6 and torch.equal(ours, run(by_chunks)), "plans differ"
    assert torch.equal(run(moe.prepare(x[:0], ids[:0], w[:0], w13, w2, 10.0, arch=SM90A)), x[:0])
    print("OK op")
    """
)


@pytest.mark.slow  # ~7 s; the GPU host: test_gpu_moe.py (and test_kernels_interpreted.py runs moe_experts here)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_gpu_moe.py checks the compiled kernels")
def test_moe_decode_kernels_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == ["OK", "plan", "OK", "combine", "OK", "op"], proc.stdout


def test_runtime_keys_of_model_shape_calls_have_an_aot_variant():
    """Every launch of a decode (b1..b64) or prefill call at V4 shapes finds its cubin in the kernel set."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_experts

    def fake(*shape):  # the weights' shape without their memory (prepare reads no weights; meta data_ptr is 0)
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    cases = [(4096, 2048, 64), (4096, 2048, 256), (5120, 2304, 384)]
    # top-6 of E routed experts, and top-7 of E + 1 (the V4 model's shared expert as one more slot per token); V4.1-
    # Flash's DSpark drafter: top-3 of 128
    shapes = [(h, i, e + shared, 6 + shared) for (h, i, e), shared in itertools.product(cases, (0, 1))]
    for hidden, inter, experts, top_k in [*shapes, (5120, 2304, 128, 3)]:
        w13, w2 = fake(experts, 2 * inter, hidden), fake(experts, hidden, inter)
        for tokens in (1, 4, 8, 16, 64, 146, 170, 1024):
            x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
            ids = torch.randint(0, experts, (tokens, top_k))
            plan = moe_experts.prepare(x, ids, torch.rand(tokens, top_k), w13, w2, 10.0, arch=SM90A)
            assert len(plan.steps) == (4 if tokens * top_k <= 1024 else 6)  # the plan: one program, or three chunked
            for kernel, launch in plan.steps:
                assert kernel.has_aot_variant(launch, SM90A), (kernel.name, hidden, experts, tokens)

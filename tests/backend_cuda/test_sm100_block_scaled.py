"""SM100's ``tl.dot_scaled`` forms: the FP8 GEMM's prefill regime over MXFP8 activations (``fp8_block_linear_mx.py``)
and the MXFP4 experts' prefill tiles (``moe_experts_mxfp4_scaled.py``), which ``arch.py`` picks for sm_100a only.

No Blackwell GPU is available.  CPU: sm_100a's plans take these forms and find their cubins while sm_90a's do not
change; Triton's interpreter runs them (it decomposes ``dot_scaled``) against core's reference, and the MXFP8 form
against a torch emulation of its scheme; sm_100a compiles them to block-scaled ``tcgen05.mma``.  GPU host: the same
forms run on the present GPU (an H200 decomposes them into bf16 MMAs; a B200 would run them natively).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.backend_cuda.test_quant_kernels import quant_cases, requires_cuda

pytest.importorskip("triton")

BF16 = torch.bfloat16


def _new_kernels() -> dict:
    from deepinfer_cuda.kernels import fp8_block_linear, moe_experts_mxfp4_scaled

    ks = (fp8_block_linear.MX_KERNEL, moe_experts_mxfp4_scaled.UP_KERNEL, moe_experts_mxfp4_scaled.DOWN_KERNEL)
    return {k.name: k for k in ks}


def _planned(arch) -> list[tuple[str, object, object]]:
    """(op, kernel, launch) of every V4.1-Flash quant call planned for ``arch`` (no GPU: weights unread)."""
    import importlib

    out = []
    for op, args in quant_cases("cpu", tokens=(1, 16, 64, 512), fill=False):
        plan = importlib.import_module(f"deepinfer_cuda.kernels.{op}").prepare(*args, arch=arch)
        out += [(op, kernel, launch) for kernel, launch in getattr(plan, "steps", [])]
    return out


# --- CPU ---------------------------------------------------------------------------------------------------------
def test_sm100_prefill_takes_the_block_scaled_forms_and_finds_their_cubins():
    from deepinfer_cuda.arch import SM90A, SM100A
    from deepinfer_cuda.kernels.fp8_block_linear import ACT_QUANT_KERNEL

    new = _new_kernels()
    planned = _planned(SM100A)
    used = {kernel.name for _, kernel, _ in planned}
    assert set(new) <= used, used
    assert ACT_QUANT_KERNEL.name not in used  # ue8m0 weights: the MX form quantizes in its tile
    missing = [f"{op}/{k.name}" for op, k, launch in planned
               if k.name in new and 0 not in launch.grid and not k.has_aot_variant(launch, SM100A)]
    assert not missing, missing
    assert not {kernel.name for _, kernel, _ in _planned(SM90A)} & set(new)
    assert all(not k.aot_variants(SM90A) for k in new.values())  # the sm_90a kernel set is unchanged


def test_fp32_weight_scales_keep_the_fp8_promotion_form_on_sm100():
    from deepinfer_cuda.arch import SM100A
    from deepinfer_cuda.kernels import fp8_block_linear as m

    w = torch.empty(5120, 2304, dtype=torch.float8_e4m3fn)
    for scale, want in ((torch.empty(40, 18, dtype=torch.float8_e8m0fnu), ["fp8_block_linear_mx"]),
                        (torch.empty(40, 18), ["fp8_act_quant", "fp8_block_linear"])):
        plan = m.prepare(torch.empty(300, 2304, dtype=BF16), w, scale, 128, 128, arch=SM100A)
        assert [k.name for k, _ in plan.steps] == want


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer.ops import op_defs
    from deepinfer.testing.conformance import assert_close, samples
    from deepinfer_cuda.arch import SM100A, Fp8LinearTiles, LaunchConfig, MoeTiles, Mxfp4Tiles
    import deepinfer_cuda.kernels.fp8_block_linear as fp8
    import deepinfer_cuda.kernels.fp8_block_grouped_linear as grouped
    import deepinfer_cuda.kernels.moe_experts_mxfp4 as moe
    from tests.backend_cuda.test_sm100_block_scaled import emulated_mxfp8_experts

    torch.set_num_threads(1)
    fp8.INTERPRETED = grouped.INTERPRETED = moe.INTERPRETED = True
    defs = op_defs()

    def run(plan):
        for kernel, launch in plan.steps:
            if all(g > 0 for g in launch.grid):
                kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
        return plan.finish()

    cfg = LaunchConfig(num_warps=4)
    mx = Fp8LinearTiles(cfg, 32, 32, 64, True, mx=True)  # small tiles: a K tail, several column tiles
    for name, groups in (("fp8_block_linear", lambda x: 1), ("fp8_block_grouped_linear", lambda x: x.shape[1])):
        op = defs[name]
        for case in samples(op, torch.bfloat16, seed=1):
            x, w, s, bn, bk = case.args
            if s.dtype != torch.float8_e8m0fnu:
                continue
            plan = fp8.plan_gemm(x, w, s, bn, bk, groups(x), arch=SM100A, interpreted=True, tiles=mx)
            assert [k.name for k, _ in plan.steps] == ["fp8_block_linear_mx"]
            op.compare(run(plan), op.reference(*case.args), case, torch.bfloat16)
            print("OK", name, case.label)

    op = defs["moe_experts_mxfp4"]
    for case in samples(op, torch.bfloat16, seed=1):
        want = op.reference(*case.args)
        for lhs in ("bf16", "e4m3"):
            tiles = Mxfp4Tiles(MoeTiles(32, cfg, 32, 64, cfg, 64, 32, cols_inner=True), dot_scaled=lhs)
            got = run(moe.prepare(*case.args, arch=SM100A, tiles=tiles))
            if lhs == "bf16":  # the reference's arithmetic: the op's tolerance
                assert_close(got, want, torch.bfloat16, op.tolerances[torch.bfloat16], case.label)
            else:  # MXFP8 activations: its scheme, emulated, to bf16 roundings
                emu = emulated_mxfp8_experts(*case.args)
                err = (got.float() - emu).abs()
                assert float(err.max()) <= 2.0**-6 * float(emu.abs().max()), (case.label, float(err.max()))
            print("OK moe", lhs, case.label)
    """
)


def mxfp8(a: torch.Tensor) -> torch.Tensor:
    """``a`` [..., K] through MXFP8 and back (fp32): per 32 columns, scale ``2^ceil(log2(amax / 448))``, e4m3 codes
    rounded to nearest even."""
    g = a.float().reshape(*a.shape[:-1], -1, 32)
    amax = g.abs().amax(-1)
    t = amax / torch.full_like(amax, 448.0)  # IEEE division (torch's CUDA `t / 448.0` multiplies by 1/448)
    e = torch.ceil(torch.log2(t.clamp_min(2.0**-126))).clamp(-126, 127)
    s = torch.exp2(e)[..., None]
    return ((g / s).to(torch.float8_e4m3fn).float() * s).reshape(a.shape)


def emulated_mxfp8_experts(x, ids, weights, w13, s13, w2, s2, limit) -> torch.Tensor:
    """``moe_experts_mxfp4`` with both GEMMs' activations through MXFP8, rounded to x.dtype where the kernels round
    (the projections, SiLU, the product, each slot's output); fp32 [T, H]."""
    from deepinfer.ops.quant import dequant_mxfp4

    dtype, inter = x.dtype, w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = mxfp8(x[tok]) @ dequant_mxfp4(w13[e], s13[e], torch.float32).T
        g, u = h[:, :inter].to(dtype).float(), h[:, inter:].to(dtype).float()
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        act = ((g / (1 + torch.exp(-g))).to(dtype).float() * u).to(dtype)
        y = (mxfp8(act) @ dequant_mxfp4(w2[e], s2[e], torch.float32).T).to(dtype).float()
        out.index_add_(0, tok, (y * weights[tok, slot, None].float()).to(dtype).float())
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_block_scaled_forms_on_this_gpu")
def test_block_scaled_forms_match_the_reference_under_the_interpreter():
    """Core's FP8 GEMM samples (ue8m0) within the op's FP8 tolerance; core's MXFP4 samples: the bf16-activation form
    within the op's tolerance, the MXFP8 one to its emulated scheme (~10 s)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK fp8_block_linear") == 4 and proc.stdout.count("OK fp8_block_grouped") == 3
    assert proc.stdout.count("OK moe") == 4, proc.stdout


def test_sm100a_compiles_the_forms_to_block_scaled_tcgen05_mmas():
    """One V4.1-Flash specialization of each form, compiled for sm_100a by the installed Triton (~10 s): the MXFP8
    forms issue ``tcgen05.mma ... kind::mxf8f6f4 ... block_scale``, the bf16-activation MXFP4 form bf16 tcgen05 MMAs
    (Triton upcasts the e2m1 tile)."""
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from deepinfer_cuda.arch import SM100A, mxfp4_block_scaled_tiles
    from deepinfer_cuda.kernels import moe_experts_mxfp4_scaled as scaled

    def mmas(kernel, variant) -> set[str]:
        sig = {p.name: "constexpr" if p.name in variant.constexprs else variant.signature[p.name].split(":")[0]
               for p in kernel.params}
        compiled = triton.compile(ASTSource(kernel.jit_fn, sig, constexprs=dict(variant.constexprs)),
                                  target=GPUTarget("cuda", SM100A.triton_arch, 32),
                                  options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})
        return set(re.findall(r"tcgen05\.mma\S*", compiled.asm["ptx"]))

    block_scaled = re.compile(r"kind::mxf8f6f4.*block_scale")
    new = _new_kernels()
    mx = new["fp8_block_linear_mx"].aot_variants(SM100A)[0]
    assert any(block_scaled.search(m) for m in mmas(new["fp8_block_linear_mx"], mx))
    up = scaled.UP_KERNEL.aot_variants(SM100A)[0]
    assert up.constexprs["LHS"] == "bf16" and any("kind::f16" in m for m in mmas(scaled.UP_KERNEL, up))
    tiles = mxfp4_block_scaled_tiles(up.constexprs["H"], up.constexprs["INTER"], "e4m3")
    e4m3 = dataclasses.replace(up, constexprs={**up.constexprs, "LHS": "e4m3", "BLOCK_K": tiles.tiles.up_block_k})
    assert any(block_scaled.search(m) for m in mmas(scaled.UP_KERNEL, e4m3))


# --- GPU ---------------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.cuda
def test_block_scaled_forms_on_this_gpu():
    """The SM100 forms' tiles launched on the present GPU (H200: Triton decomposes ``dot_scaled``; B200: natively) at
    V4.1-Flash's dims: the FP8 GEMM within the op's tolerance, the MXFP4 experts' bf16 form within the op's, its MXFP8
    form to the emulated scheme."""
    from deepinfer.ops import OpSample, op_defs
    from deepinfer.testing import assert_close
    from deepinfer_cuda.arch import SM100A, fp8_linear_config, mxfp4_block_scaled_tiles
    from deepinfer_cuda.kernel_set.dispatch import cuda_target
    from deepinfer_cuda.kernels import fp8_block_linear as fp8
    from deepinfer_cuda.kernels import moe_experts_mxfp4 as moe

    defs = op_defs()
    for op, args in quant_cases("cuda", tokens=(512,)):
        index, arch = cuda_target(args[0])
        if op in ("fp8_block_linear", "fp8_block_grouped_linear"):
            x, w, s, bn, bk = args
            groups = x.shape[1] if op == "fp8_block_grouped_linear" else 1
            tiles = fp8_linear_config(SM100A, x.shape[0], w.shape[0] // groups, x.shape[-1], groups, bk, 2)
            assert tiles.mx
            got = fp8.plan_gemm(x, w, s, bn, bk, groups, arch=arch, interpreted=False, tiles=tiles).run(index)
            cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
            defs[op].compare(got.cpu(), defs[op].reference(*args).cpu(), OpSample(cpu, label=str(x.shape)), BF16)
        elif op == "moe_experts_mxfp4" and args[0].shape[0] >= 512:
            hidden, inter = args[0].shape[1], args[3].shape[1] // 2
            want = defs[op].reference(*args)
            for lhs in ("bf16", "e4m3"):
                tiles = mxfp4_block_scaled_tiles(hidden, inter, lhs)
                got = moe.prepare(*args, arch=arch, tiles=tiles).run(index)
                if lhs == "bf16":
                    assert_close(got, want.cpu(), BF16, defs[op].tolerances[BF16], f"{op} bf16 form")
                else:
                    emu = emulated_mxfp8_experts(*args)
                    err = (got.float() - emu).abs()
                    assert float(err.max()) <= 2.0**-6 * float(emu.abs().max()), float(err.max())

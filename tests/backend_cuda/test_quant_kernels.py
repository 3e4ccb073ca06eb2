"""The released formats' CUDA kernels at V4-Flash / V4.1-Flash dims: FP8 block-scaled GEMMs (plain and grouped;
weight-only dequantization for decode, FP8 tensor cores with per-token-group activation quantization for prefill)
and MXFP4 / FP8 routed experts dequantized in the tile.

CPU (CI): every Flash call finds its cubin (``prepare`` plans without a GPU; weights are never touched);
``test_kernels_interpreted.py`` runs core's conformance samples through Triton's interpreter (both GEMM regimes).
GPU host: each op against core's reference (the FP8 ops within their activation-rounding tolerance, the MXFP4
and FP8 experts within ``moe_experts``' tolerance), the prefill regime against a torch emulation of its scheme (tight),
the activation quantizer bit for bit against torch's e4m3 cast, AOT cubin == JIT bitwise with nothing left to JIT,
no host synchronisation and CUDA-graph replay == eager at decode shapes.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tests.support.aot_jit import assert_aot_equals_jit, assert_graph_replays_without_syncs

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host: pytest tests/backend_cuda")
BF16 = torch.bfloat16
#: (N, K) of V4.1-Flash's FP8 projections: wq_a | wkv, wq_b, wo_b, the shared expert's w1 | w3 and w2
FLASH_LINEAR = ((1792, 5120), (32768, 1280), (5120, 8192), (4608, 5120), (5120, 2304))
HIDDEN, INTER, EXPERTS, TOP_K = 5120, 2304, 384, 6
OPS = ("fp8_block_linear", "fp8_block_grouped_linear", "moe_experts_mxfp4", "moe_experts_fp8", "fp8_e4m3_pack",
       "fp8_e4m3_unpack", "fp4_e2m1_pack", "fp4_e2m1_unpack")
#: (hidden, intermediate, tokens, experts, e8m0 scales) of the FP8 expert calls: V4.1-Flash's and V4-Flash's dims at
#: the MXFP4 calls' tiers (decode below one slot an expert, 6 an expert, prefill at 192), one with fp32 scales
FP8_EXPERT_CASES = ((HIDDEN, INTER, 1, EXPERTS, True), (HIDDEN, INTER, 16, EXPERTS, True),
                    (HIDDEN, INTER, 64, 64, True), (HIDDEN, INTER, 1024, 32, True), (4096, 2048, 1, 256, True),
                    (4096, 2048, 1024, 32, False))


def _module(op: str):
    return importlib.import_module(f"deepinfer_cuda.kernels.{op}")


def _fp8_weight(n: int, k: int, block: tuple[int, int], device: str, fill: bool) -> tuple[torch.Tensor, ...]:
    grid = (-(-n // block[0]), -(-k // block[1]))
    if not fill:  # shapes only (the CPU plans never read them)
        return torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(grid, dtype=torch.float8_e8m0fnu)
    data = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-16, -12, grid, device=device)  # |w| ~ 64 * 2^-14..2^-12 ~ k^-0.5 scale
    return data, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)  # e8m0 from its bits


def _mxfp4_experts(experts: int, device: str, fill: bool) -> tuple[torch.Tensor, ...]:
    shapes = ((experts, 2 * INTER, HIDDEN), (experts, HIDDEN, INTER))
    out = []
    for e, n, k in shapes:
        if not fill:
            out += [torch.empty(e, n, k // 2, dtype=torch.uint8), torch.empty(e, n, k // 32, dtype=torch.uint8)]
            continue
        out.append(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device))
        out.append(torch.randint(127 - 9, 127 - 6, (e, n, k // 32), dtype=torch.uint8, device=device))
    return tuple(out)


def _fp8_experts(experts: int, hidden: int, inter: int, device: str, fill: bool, e8m0: bool = True
                 ) -> tuple[torch.Tensor, ...]:
    """FP8 experts (w13, its scales, w2, its scales) with 128 x 128 blocks: random code bytes made in place (384
    experts at V4.1-Flash's dims are 13.6 GB), exponents 0..7 (|code| in [2^-9, 1.875], no NaN code), block scales
    2^-7..2^-5: |w| ~ k^-0.5, so the outputs are O(1)."""
    out = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        grid = (experts, -(-n // 128), -(-k // 128))
        if not fill:
            out += [torch.empty(experts, n, k, dtype=torch.float8_e4m3fn),
                    torch.empty(grid, dtype=torch.float8_e8m0fnu if e8m0 else torch.float32)]
            continue
        codes = torch.randint(0, 256, (experts, n, k), dtype=torch.uint8, device=device).bitwise_and_(0xBF)
        out.append(codes.view(torch.float8_e4m3fn))
        exps = torch.randint(-7, -4, grid, device=device)
        out.append((exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu) if e8m0 else torch.exp2(exps.float()) * 1.5)
    return tuple(out)


def quant_cases(device: str, tokens: tuple[int, ...] = (1, 16, 64, 512), fill: bool = True
                ) -> Iterator[tuple[str, tuple]]:
    """(op, args) of V4.1-Flash's calls in bf16: decode batches and a prefill chunk (``fill=False``: empty
    weights, for planning)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=BF16)

    for block in ((128, 128), (32, 32)):
        for n, k in FLASH_LINEAR:
            w, s = _fp8_weight(n, k, block, device, fill)
            for t in tokens:
                yield "fp8_block_linear", (randn(t, k), w.to(device), s.to(device), *block)
        w, s = _fp8_weight(8 * 1024, 4096, block, device, fill)  # wo_a: 8 groups of 1024 rows
        for t in tokens:
            yield "fp8_block_grouped_linear", (randn(t, 8, 4096), w.to(device), s.to(device), *block)
    from deepinfer.ops import kv_quant

    for t in tokens:  # the packed KV rows: SWA K=V, compressed latent, indexer key (V4.1-Flash's widths)
        for width, block, fmt in ((512, 32, None), (512, 16, "e4m3"), (128, 32, "ue8m0")):
            rows = randn(t, width) * 4
            extra = () if fmt is None else (fmt,)
            kind = "fp8_e4m3" if fmt is None else "fp4_e2m1"
            yield f"{kind}_pack", (rows, block, *extra)
            packed = getattr(kv_quant, f"{kind}_pack")(rows, block, *extra)
            yield f"{kind}_unpack", (packed, block, *extra, BF16)
    # decode at 384 experts (< 1 slot an expert), 6 slots an expert, and the prefill tier (192 slots an expert);
    # fewer experts where the batch hits them all: the reference dequantizes every expert a batch uses
    for t, experts in ((1, EXPERTS), (16, EXPERTS), (64, 64), (1024, 32)):
        w13, s13, w2, s2 = _mxfp4_experts(experts, device, fill)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(t)]).to(device)
        weights = torch.rand(t, TOP_K, generator=gen).to(device)
        yield "moe_experts_mxfp4", (randn(t, HIDDEN), ids, weights, w13, s13, w2, s2, 10.0)
    for hidden, inter, t, experts, e8m0 in FP8_EXPERT_CASES:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(t)]).to(device)
        weights = torch.rand(t, TOP_K, generator=gen).to(device)
        yield "moe_experts_fp8", (randn(t, hidden), ids, weights, *_fp8_experts(experts, hidden, inter, device, fill,
                                                                                   e8m0), 128, 128, 10.0)


def _steps(plan, op: str = "") -> list:
    return plan.steps if hasattr(plan, "steps") else [(_module(op).KERNEL, plan)]


# --- CPU ---------------------------------------------------------------------------------------------------------
def test_every_flash_call_finds_its_cubin():
    """A miss is silent at run time (the launch JIT-compiles, costing host time on every call)."""
    from deepinfer_cuda.arch import SM90A

    missing, ours = [], set(_kernels())  # (the routing plan's kernels are moe_experts' own, tested there)
    for op, args in quant_cases("cpu", tokens=(1, 16, 64, 512), fill=False):
        for kernel, launch in _steps(_module(op).prepare(*args, arch=SM90A), op):
            if kernel.name in ours and 0 not in launch.grid and not kernel.has_aot_variant(launch, SM90A):
                missing.append(f"{op}/{kernel.name} {[tuple(a.shape) for a in args if hasattr(a, 'shape')]}")
    assert not missing, missing


def test_tma_decode_tiles_find_their_cubins(monkeypatch):
    """A table entry asking for TMA weight tiles (FP8 decode, MXFP4 decode) lists its descriptor variant, and only
    then: with every entry's TMA off, no descriptor variant is listed and every call still finds its cubin."""
    import dataclasses

    from deepinfer_cuda import arch
    from deepinfer_cuda.kernels import fp8_block_linear as m
    from deepinfer_cuda.kernels import moe_experts_mxfp4

    def descriptor_variants() -> int:
        return sum(v.signature["w_ptr"].startswith("tensordesc<") for v in m.KERNEL.aot_variants(arch.SM90A))

    def mxfp4_descriptor_variants() -> bool:
        return any(v.signature["w13_ptr"].startswith("tensordesc<")
                   for v in moe_experts_mxfp4.UP_KERNEL.aot_variants(arch.SM90A))

    assert descriptor_variants() >= sum(t.tma for t in arch.FP8_DECODE_TILES.values()) > 0
    assert mxfp4_descriptor_variants()
    test_every_flash_call_finds_its_cubin()
    w, s = _fp8_weight(1792, 5120, (128, 128), "cpu", False)
    launch = m.prepare(torch.empty(1, 5120, dtype=BF16), w, s, 128, 128, arch=arch.SM90A).steps[0][1]
    tile = arch.FP8_DECODE_TILES[(1792, 5120, 1, 1)]
    assert type(launch.args["w_ptr"]).__name__ == "TensorDescriptor"
    assert launch.args["TMA_STAGES"] == tile.num_stages and launch.args["w_ptr"].block_shape == [tile.block_n,
                                                                                                 tile.block_k]
    for key, tile in list(arch.FP8_DECODE_TILES.items()):
        monkeypatch.setitem(arch.FP8_DECODE_TILES, key, dataclasses.replace(tile, tma=False))
    mxfp4 = arch.MXFP4_DECODE_TILES[(HIDDEN, INTER)]
    monkeypatch.setitem(arch.MXFP4_DECODE_TILES, (HIDDEN, INTER), dataclasses.replace(mxfp4, tma=False))
    assert descriptor_variants() == 0 and not mxfp4_descriptor_variants()
    test_every_flash_call_finds_its_cubin()


TMA_SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import torch
    from deepinfer_cuda.arch import SM90A, Fp8DecodeTile, fp8_decode_tiles
    import deepinfer_cuda.kernels.fp8_block_linear as m

    torch.manual_seed(0)
    # (N per group, K, groups, rows, scale block, e8m0 scales): a K tail, a group's N not a multiple of the column
    # tile (the descriptor reads the next group's rows there), 32-wide blocks, fp32 scales (the unfactored path)
    for n, k, groups, rows, block, e8m0 in ((96, 256, 1, 1, 128, True), (40, 192, 2, 3, 128, True),
                                            (48, 160, 1, 5, 32, True), (40, 128, 1, 2, 128, False)):
        x = (torch.randn(rows, groups, k) if groups > 1 else torch.randn(rows, k)).bfloat16()
        w = (torch.randn(groups * n, k) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        grid = (-(-groups * n // block), -(-k // block))
        exps = torch.randint(-16, -12, grid)
        s = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu) if e8m0 else torch.exp2(exps.float()) * 1.5
        for tile in (Fp8DecodeTile(True, 4, 128, 2, 4, 2), Fp8DecodeTile(False, 16, 64, 3, 4, 2),
                     Fp8DecodeTile(False, 32, 128, 1, 4, 3)):
            outs = []
            for tma in (False, True):
                plan = m.plan_gemm(x, w, s, block, block, groups, arch=SM90A, interpreted=True,
                                   tiles=fp8_decode_tiles(dataclasses.replace(tile, tma=tma), 2))
                gemm = next(launch for kernel, launch in plan.steps if kernel is m.KERNEL)
                assert (gemm.args["TMA_STAGES"] > 0) == tma
                for kernel, launch in plan.steps:
                    kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                               num_stages=launch.config.num_stages)
                outs.append(plan.finish())
            assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (n, k, groups, tile)
        print("OK", n, k, groups, block, e8m0)

    import deepinfer_cuda.kernels.moe_experts_mxfp4 as moe
    from deepinfer_cuda.arch import LaunchConfig, MoeTiles, Mxfp4Tiles

    moe.INTERPRETED = True
    # MXFP4 row loops: column tiles past an expert's rows (down: 64 of 96), tiles wider than a step's K tail
    for h, i, e, k, tokens in ((96, 64, 16, 6, 3), (64, 32, 8, 2, 2)):
        w13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8)
        s13 = torch.randint(118, 121, (e, 2 * i, h // 32), dtype=torch.uint8)
        w2 = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8)
        s2 = torch.randint(118, 121, (e, h, i // 32), dtype=torch.uint8)
        x = torch.randn(tokens, h).bfloat16()
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
        rw = torch.rand(tokens, k)
        cfg = LaunchConfig(num_warps=4, num_stages=2)
        for up_n, up_k, down_n, down_k in ((16, 64, 64, 32), (32, 32, 16, 64)):
            outs = []
            for tma in (False, True):
                tiles = Mxfp4Tiles(MoeTiles(16, cfg, up_n, up_k, cfg, down_n, down_k), row_loop=True, tma=tma)
                plan = moe.prepare(x, ids, rw, w13, s13, w2, s2, 10.0, arch=SM90A, tiles=tiles)
                for kernel, launch in plan.steps:
                    assert kernel not in (moe.UP_KERNEL, moe.DOWN_KERNEL) or (launch.args["TMA_STAGES"] > 0) == tma
                    if all(g > 0 for g in launch.grid):
                        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                                   num_stages=launch.config.num_stages)
                outs.append(plan.finish())
            assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (h, i, up_n, down_n)
        print("OK mxfp4", h, i)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: test_tma_decode_tiles_equal_pointer_loads_bitwise checks it")
def test_tma_decode_tiles_equal_pointer_loads_under_the_interpreter():
    """The TMA weight tiles feed the same math as the pointer loads, FP8 GEMM and MXFP4 row loop: equal bits
    (interpreter; ~20 s; the GPU host's ``test_tma_decode_tiles_equal_pointer_loads_bitwise`` checks the same)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", TMA_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 6, proc.stdout


FP8_EXPERTS_SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer.ops.quant_gemm import _dequant_fp8_experts
    from deepinfer_cuda.arch import SM90A, moe_fp8_config
    import deepinfer_cuda.kernels.moe_experts as bf16
    import deepinfer_cuda.kernels.moe_experts_fp8 as fp8

    def run(plan):
        for kernel, launch in plan.steps:
            if all(g > 0 for g in launch.grid):
                kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                           num_stages=launch.config.num_stages)
        return plan.finish()

    bf16.INTERPRETED = fp8.INTERPRETED = True
    torch.manual_seed(0)
    h, i, e, k = 160, 96, 8, 2  # partial 128-blocks in both dims; 2I = 192 crosses a block inside the up rows
    # a decode tier (2 slots over 8 experts), 16-row tiles (4 an expert), the prefill tier's 128-row tiles (32)
    for tokens, block, e8m0 in ((2, 128, True), (16, 128, False), (16, 32, True), (128, 128, True)):
        stacks = []
        for n, kk in ((2 * i, h), (h, i)):
            codes = (torch.randn(e, n, kk) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            exps = torch.randint(-16, -12, (e, -(-n // block), -(-kk // block)))
            scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu) if e8m0 else torch.exp2(exps.float()) * 1.5
            stacks += [codes, scale]
        x = torch.randn(tokens, h).bfloat16()
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
        rw = torch.rand(tokens, k)
        tiles = moe_fp8_config(SM90A, tokens * k // e, h, i)
        got = run(fp8.prepare(x, ids, rw, *stacks, block, block, 10.0, arch=SM90A, tiles=tiles))
        w13 = _dequant_fp8_experts(stacks[0], stacks[1], block, block, torch.bfloat16)
        w2 = _dequant_fp8_experts(stacks[2], stacks[3], block, block, torch.bfloat16)
        want = run(bf16.prepare(x, ids, rw, w13, w2, 10.0, arch=SM90A, tiles=tiles))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tokens, block, e8m0)
        print("OK fp8 experts", tokens, block, e8m0, tiles.block_m)
    """
)


@pytest.mark.slow  # ~9 s; the GPU host: test_quant_kernels_match_the_reference_at_flash_dims
@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: test_quant_kernels_match_the_reference_at_flash_dims checks it")
def test_fp8_experts_are_the_bf16_kernel_on_the_dequantized_weights_under_the_interpreter():
    """``moe_experts_fp8``'s kernels dequantize each weight tile exactly as the reference does, so at every tier's
    tiles (decode 16-row, prefill 128-row), with ue8m0 and fp32 scales and 32 / 128 blocks, they give the bf16
    ``moe_experts`` kernels' bits on the dequantized weights (interpreter; ~20 s)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", FP8_EXPERTS_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 4, proc.stdout


@pytest.mark.slow
def test_quant_kernel_set_builds_for_sm90a(tmp_path):
    """Every AOT variant compiles for sm_90a on the CPU (~45 s on 2 cores); the prefill GEMM issues FP8 wgmmas."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernel_set.build import build_kernel_set

    kernels = _kernels()
    manifest = build_kernel_set(tmp_path, [SM90A], sorted(kernels))
    built = {name: sum(e.kernel == name for e in manifest.kernels) for name in kernels}
    assert built == {name: len(k.aot_variants(SM90A)) for name, k in kernels.items()}


@pytest.mark.slow
def test_kv_packers_compile_to_ieee_division_and_round_to_nearest_even():
    """As the fake quants (test_v41_kernels.py): ``div.rn`` and ``cvt.rni``, the operations the interpreter checks."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from deepinfer_cuda.arch import SM90A

    for op in ("fp8_e4m3_pack", "fp4_e2m1_pack"):
        kernel = _module(op).KERNEL
        for v in kernel.aot_variants(SM90A):
            signature = {p.name: "constexpr" if p.name in v.constexprs else v.signature[p.name].split(":")[0]
                         for p in kernel.params}
            compiled = triton.compile(ASTSource(kernel.jit_fn, signature, constexprs=dict(v.constexprs)),
                                      target=GPUTarget("cuda", SM90A.triton_arch, 32),
                                      options={"num_warps": v.num_warps})
            ops = set(re.findall(r"\b(div\.[a-z0-9.]+|rcp\.[a-z0-9.]+|cvt\.rni\.f32\.f32)", compiled.asm["ptx"]))
            assert ops == {"div.rn.f32", "cvt.rni.f32.f32"}, (op, v.constexprs, ops)


def _kernels() -> dict:
    from deepinfer_cuda.kernels import (
        fp4_e2m1_pack,
        fp4_e2m1_unpack,
        fp8_block_linear,
        fp8_e4m3_pack,
        fp8_e4m3_unpack,
        moe_experts_fp8,
        moe_experts_mxfp4,
    )

    ks = (fp8_block_linear.KERNEL, fp8_block_linear.ACT_QUANT_KERNEL, fp8_block_linear.SPLIT_K_SUM_KERNEL,
          moe_experts_mxfp4.UP_KERNEL, moe_experts_mxfp4.DOWN_KERNEL, fp8_e4m3_pack.KERNEL, fp8_e4m3_unpack.KERNEL,
          fp4_e2m1_pack.KERNEL, fp4_e2m1_unpack.KERNEL, moe_experts_fp8.UP_KERNEL, moe_experts_fp8.DOWN_KERNEL)
    return {k.name: k for k in ks}


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer_cuda.arch import SM90A
    import deepinfer_cuda.kernels.fp8_block_linear as m

    m.INTERPRETED = True
    torch.manual_seed(0)
    for block in ((128, 128), (32, 32)):
        x = (torch.randn(70, 256) * torch.exp2(torch.randint(-12, 8, (70, 1)).float())).to(torch.bfloat16)
        x[0, :block[1]] = 0.0  # a group below the amax floor
        w = torch.randn(64, 256).to(torch.float8_e4m3fn)
        s = torch.ones(64 // block[0] + (64 % block[0] > 0), 256 // block[1])
        plan = m.prepare(x, w, s, *block, arch=SM90A)
        kernel, launch = plan.steps[0]
        assert kernel.name == "fp8_act_quant"
        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
        g = x.float().view(70, -1, block[1])
        amax = g.abs().amax(-1).clamp_min(1e-4)
        want_s = amax / torch.full_like(amax, 448.0)  # IEEE division (torch's CUDA `t / 448.0` multiplies by 1/448)
        want_q = (g / want_s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(launch.args["s_ptr"].view_as(want_s), want_s), block
        assert torch.equal(launch.args["q_ptr"].view_as(want_q), want_q), block
        print("OK act quant", block)
    """
)


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: the GPU test checks the compiled quantizer")
def test_activation_quantizer_is_torchs_e4m3_cast_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 2, proc.stdout


# --- GPU ---------------------------------------------------------------------------------------------------------
def _call(op: str, args: tuple):
    return getattr(_module(op), op)(*args)


def _check_against_reference(op: str, args: tuple, got: torch.Tensor) -> None:
    from deepinfer.ops import OpSample, op_defs
    from deepinfer.testing import assert_close

    definition = op_defs()[op]
    expected = definition.reference(*args)  # on the GPU: the CPU would take minutes at these dims
    if definition.compare is not None:  # the FP8 GEMMs: within the activation's FP8 rounding
        cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        definition.compare(got.cpu(), expected.cpu(), OpSample(cpu, label=str(tuple(args[0].shape))), BF16)
    else:
        assert_close(got, expected.cpu(), BF16, definition.tolerances[BF16], f"{op} {tuple(args[0].shape)}")


@requires_cuda
@pytest.mark.cuda
def test_quant_kernels_match_the_reference_at_flash_dims():
    for op, args in quant_cases("cuda"):
        _check_against_reference(op, args, _call(op, args))


def _emulated_prefill(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The prefill regime's scheme in torch: x quantized per token and block_k channels (fp32 scale amax / 448,
    amax >= 1e-4), each K block's FP8 product promoted to fp32 with both scales."""
    from deepinfer.ops.quant import scale_values

    bn, bk = block
    m, k = x.shape
    g = x.float().view(m, k // bk, bk)
    xs = g.abs().amax(-1).clamp_min(1e-4) / 448.0
    xq = (g / xs[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    ws = scale_values(s).repeat_interleave(bn, 0)[: w.shape[0]]  # [N, K / bk]
    acc = torch.zeros(m, w.shape[0], device=x.device)
    for j in range(k // bk):
        part = xq[:, j] @ w[:, j * bk : (j + 1) * bk].float().T
        acc += part * xs[:, j, None] * ws[None, :, j]
    return acc.to(x.dtype)


@requires_cuda
@pytest.mark.cuda
def test_prefill_regime_is_its_scheme_and_quantizes_activations_like_torch():
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import fp8_block_linear as m

    for block in ((128, 128), (32, 32)):
        w, s = _fp8_weight(5120, 2304, block, "cuda", True)
        x = torch.randn(300, 2304, device="cuda", dtype=BF16)
        plan = m.prepare(x, w, s, *block, arch=SM90A)
        assert [k.name for k, _ in plan.steps] == ["fp8_act_quant", "fp8_block_linear"]
        got = plan.run(torch.cuda.current_device())
        xq, xs = plan.steps[0][1].args["q_ptr"], plan.steps[0][1].args["s_ptr"]
        g = x.float().view(300, -1, block[1])
        amax = g.abs().amax(-1).clamp_min(1e-4)
        want_s = amax / torch.full_like(amax, 448.0)  # IEEE division (torch's CUDA `t / 448.0` multiplies by 1/448)
        assert torch.equal(xs.view_as(want_s), want_s)
        want_q = (g / want_s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(xq.view_as(want_q), want_q)
        want = _emulated_prefill(x, w, s, block)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)  # accumulation order only


@requires_cuda
@pytest.mark.cuda
def test_tma_decode_tiles_equal_pointer_loads_bitwise():
    """Each tuned FP8 decode tile, and the MXFP4 decode row loop, read through TMA (3 stages) against the same
    tiles' pointer loads at V4.1-Flash's dims: only the load path differs.  The tl.dot forms agree bit for bit (the
    MMA order does not change); a row loop's fp32 sums follow the register layout Triton gives the tile, which a
    descriptor load can change (the H200 showed it once: (32768, 1280) at one row), so row loops agree to one
    rounding of the output dtype."""
    import dataclasses

    from deepinfer_cuda.arch import FP8_DECODE_TILES, SM90A, fp8_decode_tiles
    from deepinfer_cuda.kernels import fp8_block_linear as m

    differ = []
    for (n, k, groups, tier), tile in FP8_DECODE_TILES.items():
        w, s = _fp8_weight(n * groups, k, (128, 128), "cuda", True)
        rows = 1 if tier == 1 else 16
        x = torch.randn(rows, groups, k, device="cuda", dtype=BF16) if groups > 1 else torch.randn(
            rows, k, device="cuda", dtype=BF16)
        outs = [m.plan_gemm(x, w, s, 128, 128, groups, arch=SM90A, interpreted=False,
                            tiles=fp8_decode_tiles(dataclasses.replace(tile, tma=tma, num_stages=3), 2)
                            ).run(torch.cuda.current_device()) for tma in (False, True)]
        if not _same_up_to_rounding(outs[0], outs[1], exact=not tile.row_loop):
            differ.append((n, k, groups, tier, tile.row_loop, float((outs[0] - outs[1]).abs().max())))
    from deepinfer_cuda.arch import LaunchConfig, moe_mxfp4_config
    from deepinfer_cuda.kernels import moe_experts_mxfp4

    base = moe_mxfp4_config(SM90A, 0, HIDDEN, INTER)  # the decode row loop, both kernels at 3 stages
    staged = dataclasses.replace(base.tiles, up=LaunchConfig(num_warps=base.tiles.up.num_warps, num_stages=3),
                                 down=LaunchConfig(num_warps=base.tiles.down.num_warps, num_stages=3))
    gen = torch.Generator().manual_seed(0)
    w13, s13, w2, s2 = _mxfp4_experts(EXPERTS, "cuda", True)
    for t in (1, 16):
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]).cuda()
        x, rw = torch.randn(t, HIDDEN, device="cuda", dtype=BF16), torch.rand(t, TOP_K, device="cuda")
        outs = [moe_experts_mxfp4.prepare(x, ids, rw, w13, s13, w2, s2, 10.0, arch=SM90A,
                                          tiles=dataclasses.replace(base, tiles=staged, tma=tma)
                                          ).run(torch.cuda.current_device()) for tma in (False, True)]
        if not _same_up_to_rounding(outs[0], outs[1], exact=False):
            differ.append(("mxfp4", t, float((outs[0] - outs[1]).abs().max())))
    assert not differ, differ


def _same_up_to_rounding(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """``a == b``, or (``exact=False``) every element within one rounding of ``a``'s dtype (fp32 sums of the same
    terms in another order, rounded once)."""
    if torch.equal(a, b):
        return True
    ulp = torch.finfo(a.dtype).eps
    x, y = a.float(), b.float()
    return not exact and bool(((x - y).abs() <= torch.maximum(x.abs(), y.abs()) * ulp).all())


@pytest.fixture(scope="module")
def quant_kernel_set(tmp_path_factory):
    from deepinfer_cuda.kernel_set.build import build_kernel_set
    from deepinfer_cuda.kernel_set.dispatch import device_arch

    out = tmp_path_factory.mktemp("quant_kernel_set")
    build_kernel_set(out, [device_arch(torch.cuda.current_device())], sorted(_kernels()))
    return out


@requires_cuda
@pytest.mark.cuda
def test_quant_aot_cubins_equal_jit_bitwise_and_nothing_jits(quant_kernel_set):
    from deepinfer_cuda.kernel_set.dispatch import active_kernel_set

    assert_aot_equals_jit(quant_kernel_set, _kernels().values(), list(quant_cases("cuda", tokens=(1, 512))), _call,
                          restore=active_kernel_set())


@requires_cuda
@pytest.mark.cuda
def test_quant_kernels_do_not_synchronise_and_replay_from_cuda_graphs():
    assert_graph_replays_without_syncs(list(quant_cases("cuda", tokens=(1, 16))), _call)


def test_gpu_tests_skip_with_a_reason_on_cpu():
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    assert requires_cuda.args[0] is True and "GPU" in requires_cuda.kwargs["reason"]


def test_emulation_helper_is_the_dense_product_without_rounding():
    """The torch emulation used on the GPU, checked on the CPU: with activations already on the FP8 grid of their
    group scale it is the dense product of the dequantized weight."""
    from deepinfer.ops import OpTable

    w, s = _fp8_weight(64, 256, (32, 32), "cpu", True)
    x = torch.zeros(3, 256)
    x[:, ::32] = 448.0  # every group's amax is 448, so its scale is 1 and the codes are exact
    x[:, 1::32] = torch.tensor([1.0, -2.0, 0.5])[:, None]
    got = _emulated_prefill(x, w, s, (32, 32))
    want = F.linear(x, OpTable().dequant_fp8_block(w, s, 32, 32, torch.float32))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-3)

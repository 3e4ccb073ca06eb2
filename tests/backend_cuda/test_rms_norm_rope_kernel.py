"""The fused RMSNorm + RoPE kernel gives the bits of the rms_norm and rope kernels composed.

On the CPU: (1) under Triton's interpreter, the fused kernel against the two kernels' own interpreted runs, bit for
bit, on the cases the conformance samples miss (partial row tiles, V4's 64 heads, the latent as a strided column
slice, bf16 weights, positions to 2^20, YaRN scaling); (2) compiled for sm_90a (no GPU needed), the fused kernel's
row tile and sum of squares have rms_norm's layout, so the reduction order (which the interpreter cannot show) is
the same on the GPU.  On the GPU: the compiled kernels themselves, fused against composed, bit for bit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    import triton.language as tl
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import rms_norm, rms_norm_rope, rope

    torch.set_num_threads(1)
    for module in (rope, rms_norm_rope):  # libdevice has no interpreter implementation
        module.libdevice = types.SimpleNamespace(cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x))

    def run(module, *args):
        launch = module.prepare(*args, arch=SM90A)
        if all(g > 0 for g in launch.grid):
            module.KERNEL.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                             num_stages=launch.config.num_stages)
        return launch.result

    gen = torch.Generator().manual_seed(0)
    checked = 0
    # (tokens, heads, dim, rope_dim, weight, column slice of a wider row, attention_scaling)
    cases = [(1, 64, 512, 64, None, 0, 1.0), (3, 64, 512, 64, None, 0, 1.0), (13, 1, 512, 64, "fp32", 1024, 1.0),
             (1, 1, 512, 64, "fp32", 2048, 1.0), (5, 1, 512, 64, "x", 0, 1.25), (37, 1, 128, 64, "fp32", 64, 1.0),
             (2, 7, 128, 64, None, 0, 0.75), (9, 3, 64, 16, "fp32", 0, 1.0), (4, 2, 64, 64, "x", 0, 1.0)]
    for dtype in (torch.bfloat16, torch.float32):
        for tokens, heads, dim, rope_dim, weight, extra, scaling in cases:
            shape = (tokens, heads, dim) if heads > 1 else (tokens, dim + extra)
            x = (4 * torch.randn(*shape, generator=gen)).to(dtype)
            if extra:
                x = x[:, extra // 2 : extra // 2 + dim]  # not the row's start: the latent's place in the projection
            w = None if weight is None else (1 + 0.1 * torch.randn(dim, generator=gen)).to(
                dtype if weight == "x" else torch.float32)
            positions = torch.randint(0, 1 << 20, (tokens,), generator=gen)
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
            fused = run(rms_norm_rope, x, w, 1e-6, positions, inv_freq, scaling)
            composed = run(rope, run(rms_norm, x, w, 1e-6), positions, inv_freq, scaling, False)
            where = f"{dtype} {tuple(x.shape)} stride {x.stride()} weight {weight} rope {rope_dim}"
            assert fused.shape == x.shape and fused.dtype == dtype, where
            assert torch.equal(fused.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               composed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), where
            checked += 1
    print("OK", checked)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the GPU test below checks compiled kernels")
def test_fused_equals_composed_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "OK 18" in proc.stdout, proc.stdout


def _reduced_tile_layout(kernel, **constexprs) -> str:
    """The layout of the tensor the kernel's one ``tt.reduce`` sums, compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from deepinfer_cuda.arch import SM90A

    variant = next(v for v in kernel.aot_variants(SM90A)
                   if all(v.constexprs.get(k) == c or v.signature.get(k) == c for k, c in constexprs.items()))
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in variant.constexprs:
            signature[p.name] = "constexpr"
            continue
        ty, _, hint = variant.signature[p.name].partition(":")
        signature[p.name] = ty
        if hint == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel.jit_fn, signature, constexprs=dict(variant.constexprs), attrs=attrs)
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": variant.num_warps, "num_stages": variant.num_stages}).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    reduced = re.findall(r"\}\) : \(tensor<\w+, (#\w+)>\) -> tensor<", ttgir)
    assert len(reduced) == 1, ttgir
    return layouts[reduced[0]]


@pytest.mark.parametrize("dim, heads, dtype, weight", [(512, 64, "bf16", None), (512, 1, "bf16", "fp32"),
                                                       (512, 1, "fp32", "fp32"), (128, 64, "bf16", None)])
def test_fused_sums_squares_in_the_layout_rms_norm_does(dim, heads, dtype, weight):
    from deepinfer_cuda.kernels import rms_norm, rms_norm_rope

    w = {"HAS_WEIGHT": weight is not None, **({"w_ptr": f"*{weight}:D"} if weight else {})}
    ours = _reduced_tile_layout(rms_norm_rope.KERNEL, N=dim, HEADS=heads, x_ptr=f"*{dtype}:D", **w)
    theirs = _reduced_tile_layout(rms_norm.KERNEL, N=dim, x_ptr=f"*{dtype}:D", **w)
    assert ours == theirs and "blocked" in ours


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; run on the GPU host")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_composed_kernels_on_the_gpu(dtype):
    from deepinfer_cuda.kernels.rms_norm import rms_norm
    from deepinfer_cuda.kernels.rms_norm_rope import rms_norm_rope
    from deepinfer_cuda.kernels.rope import rope

    gen = torch.Generator(device="cuda").manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device="cuda") / 64))
    for tokens in (1, 7, 64, 1024):
        positions = torch.randint(0, 1 << 20, (tokens,), device="cuda", generator=gen)
        q = 4 * torch.randn(tokens, 64, 512, device="cuda", generator=gen).to(dtype)
        projection = torch.randn(tokens, 4160, device="cuda", generator=gen).to(dtype)  # a CSA layer's w_in rows
        latent, w = projection[:, 1024:1536], 1 + 0.1 * torch.randn(512, device="cuda", generator=gen)
        for x, weight in [(q, None), (latent, w), (latent, w.to(dtype)), (q[:, :, :128].contiguous(), None)]:
            fused = rms_norm_rope(x, weight, 1e-6, positions, inv_freq)
            composed = rope(rms_norm(x, weight, 1e-6), positions, inv_freq)
            assert torch.equal(fused, composed), f"{tuple(x.shape)} {dtype} weight {weight is not None}"

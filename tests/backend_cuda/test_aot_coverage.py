"""The V4 model's calls of the small per-token kernels find their cubins in the kernel set (checked on the CPU:
``prepare`` plans a launch without a GPU, and its runtime key must be among the kernel's AOT variants).  A miss
is silent at run time — the launch falls back to Triton JIT, which costs host time on every call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda.arch import SM90A  # noqa: E402
from deepinfer_cuda.kernels import rms_norm, rms_norm_rope, rope  # noqa: E402

BF16 = torch.bfloat16


def _covered(module, launch) -> bool:
    return module.KERNEL.has_aot_variant(launch, SM90A)


@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32, None], ids=["bf16_w", "fp32_w", "no_w"])
@pytest.mark.parametrize("shape", [(1024,), (512,), (64, 512), (128,), (4096,)], ids=str)
def test_rms_norm_of_v4_rows(tokens, weight_dtype, shape):
    """q_lora / kv latent / per-head q / compressed entries / hidden, bf16, with V4's fp32 norm weights."""
    x = torch.randn(tokens, *shape, dtype=BF16)
    weight = None if weight_dtype is None or len(shape) > 1 else torch.randn(shape[-1], dtype=weight_dtype)
    assert _covered(rms_norm, rms_norm.prepare(x, weight, 1e-6, arch=SM90A))


@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("shape", [(64, 512), (512,), (64, 128), (128,)], ids=str)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_of_v4_rows(tokens, shape, inverse):
    x = torch.randn(tokens, *shape, dtype=BF16)
    launch = rope.prepare(x, torch.arange(tokens), torch.rand(32), 1.0, inverse, arch=SM90A)
    assert _covered(rope, launch)


@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("width", [1536, 2560, 4160, 1792], ids=lambda w: f"w_in{w}")
def test_rms_norm_rope_of_v4_rows(tokens, dtype, width):
    """Attention._project: per-head queries [T, 64, 512] (unweighted) and the K=V latent, columns q_lora..+512 of
    the layer's fused input projection (SWA / HCA / CSA widths of V4-Flash, SWA of V4.1) with its fp32 weight."""
    positions, inv_freq = torch.arange(tokens), torch.rand(32)
    q = torch.randn(tokens, 64, 512, dtype=dtype)
    assert _covered(rms_norm_rope, rms_norm_rope.prepare(q, None, 1e-6, positions, inv_freq, 1.0, arch=SM90A))
    q_lora = 1280 if width == 1792 else 1024
    latent = torch.randn(tokens, width, dtype=dtype)[:, q_lora : q_lora + 512]
    weight = torch.randn(512, dtype=torch.float32)
    assert _covered(rms_norm_rope, rms_norm_rope.prepare(latent, weight, 1e-6, positions, inv_freq, 1.0, arch=SM90A))

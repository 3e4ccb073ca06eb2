"""The V4 model's calls of the small per-token kernels find their cubins in the kernel set (checked on the CPU:
``prepare`` plans a launch without a GPU, and its runtime key must be among the kernel's AOT variants).  A miss
is silent at run time — the launch falls back to Triton JIT, which costs host time on every call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda.arch import SM90A  # noqa: E402
from deepinfer_cuda.kernel_set.manifest import variant_key  # noqa: E402
from deepinfer_cuda.kernel_set.specialize import signature_of  # noqa: E402
from deepinfer_cuda.kernels import rms_norm, rope  # noqa: E402

BF16 = torch.bfloat16


def _covered(module, launch) -> bool:
    kernel = module.KERNEL
    sig, const = signature_of(kernel.params, launch.args)
    key = variant_key(kernel.name, "sm_90a", sig, const, launch.config.num_warps, launch.config.num_stages)
    return key in {variant_key(kernel.name, "sm_90a", v.signature, v.constexprs, v.num_warps, v.num_stages)
                   for v in kernel.aot_variants(SM90A)}


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

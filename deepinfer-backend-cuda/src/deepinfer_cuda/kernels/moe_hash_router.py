"""Hash routing's weights: the router kernel of ``moe_router.py`` with the experts given instead of chosen.

Overrides core's ``moe_hash_router(x, weight, ids, routed_scaling_factor, score_func)`` (deepinfer/ops/moe.py):
V4's first layers take their k experts from a frozen token-id table; only the weights come from the router's
scores.  The logits GEMM stays cuBLAS; scores, the gather at ``ids`` and the renormalisation are one launch of the
router's ``@triton.jit`` function with ``HASH`` set (the same arithmetic as the learned router's weights), as this
op's own :data:`KERNEL` with the hash variants.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.moe_router import aot_variants, moe_router_kernel, plan_routes
from deepinfer_cuda.override import override

#: As ``moe_router.INTERPRETED`` (libdevice swapped for ``tl`` functions under Triton's CPU interpreter), for this op.
INTERPRETED = False

KERNEL = TritonKernel("moe_hash_router", moe_router_kernel, functools.partial(aot_variants, hash_ids=True))


def prepare(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float, score_func: str,
            *, arch: CudaArch) -> Launch:
    """Plan ``moe_hash_router(...)`` for ``arch``: the logits GEMM runs, the kernel is planned; ``result`` is the
    weights [T, k] fp32."""
    launch = plan_routes(F.linear(x, weight), None, ids, ids.shape[-1], routed_scaling_factor, score_func, arch=arch,
                         interpreted=INTERPRETED)
    launch.result = launch.result[0]
    return launch


@override("moe_hash_router", aot=(KERNEL,))
def moe_hash_router(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float, score_func: str
) -> torch.Tensor:
    """Weights [T, k] fp32 of the given experts ``ids`` [T, k] int64, renormalised and scaled."""
    index, arch = cuda_target(x)
    return prepare(x, weight, ids, routed_scaling_factor, score_func, arch=arch).run(KERNEL, index)

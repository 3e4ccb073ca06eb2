"""Hash routing's weights: the router kernel of ``moe_router.py`` with the experts given instead of chosen.

Overrides core's ``moe_hash_router(x, weight, ids, routed_scaling_factor, score_func)`` (deepinfer/ops/moe.py):
V4's first layers take their k experts from a frozen token-id table; only the weights come from the router's
scores.  The logits GEMM stays cuBLAS; scores, the gather at ``ids`` and the renormalisation are one launch of
:data:`KERNEL` (``HASH`` constexpr), the same arithmetic as the learned router's weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, cuda_target
from deepinfer_cuda.kernels.moe_router import KERNEL, plan_routes

__all__ = ["KERNEL", "moe_hash_router", "prepare"]

#: As ``moe_router.INTERPRETED`` (libdevice swapped for ``tl`` functions under Triton's CPU interpreter), for this op.
INTERPRETED = False


def prepare(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float, score_func: str,
            *, arch: CudaArch) -> Launch:
    """Plan ``moe_hash_router(...)`` for ``arch``: the logits GEMM runs, the kernel is planned; ``result`` is the
    weights [T, k] fp32."""
    launch = plan_routes(F.linear(x, weight), None, ids, ids.shape[-1], routed_scaling_factor, score_func, arch=arch,
                         interpreted=INTERPRETED)
    launch.result = launch.result[0]
    return launch


def moe_hash_router(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float, score_func: str
) -> torch.Tensor:
    """Weights [T, k] fp32 of the given experts ``ids`` [T, k] int64, renormalised and scaled."""
    index, arch = cuda_target(x)
    return prepare(x, weight, ids, routed_scaling_factor, score_func, arch=arch).run(KERNEL, index)

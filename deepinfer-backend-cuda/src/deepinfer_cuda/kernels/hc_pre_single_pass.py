"""V4.1's single-pass mHC site: ``hc_pre``'s two kernels, the finish collapsing with the previous site's ``pre``.

Overrides core's ``hc_pre_single_pass(streams, previous_pre, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)``
(deepinfer/ops/mhc.py).  The mix kernel is ``hc_pre``'s unchanged; the finishing kernel runs with
``SINGLE_PASS``: its chunk programs collapse with ``previous_pre`` instead of this site's gate, and its last
program writes this site's ``pre`` next to ``post`` and ``comb`` (the same arithmetic ``hc_pre`` collapses with).
Batch-invariant for the same reasons as ``hc_pre``.
"""

from __future__ import annotations

import torch

from deepinfer_cuda.arch import CudaArch, HcPreTiles
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, cuda_target
from deepinfer_cuda.kernels import hc_pre
from deepinfer_cuda.kernels.hc_pre import MIX_KERNEL, SINGLE_PASS_KERNEL, plan_hc_pre
from deepinfer_cuda.override import override

#: Set by the CPU tests under Triton's interpreter (see ``hc_pre``'s mix kernel).
INTERPRETED = False
KERNEL = SINGLE_PASS_KERNEL


def prepare(streams: torch.Tensor, previous_pre: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
            scale: torch.Tensor, norm_eps: float, hc_eps: float, sinkhorn_iters: int, *, arch: CudaArch,
            tiles: HcPreTiles | None = None) -> LaunchChain:
    """Plan ``hc_pre_single_pass(...)`` for ``arch``: outputs and workspaces allocated, nothing launched."""
    return plan_hc_pre(streams, previous_pre, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, arch=arch,
                       tiles=tiles, interpreted=INTERPRETED)


def covers(streams: torch.Tensor, previous_pre: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
           scale: torch.Tensor, norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> bool:
    """As ``hc_pre`` (the same kernels)."""
    return hc_pre.covers(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


# batch-invariant: hc_pre's kernels; by construction (not yet checked on an H200)
@override("hc_pre_single_pass", coverage=covers, batch_invariant=True, aot=(MIX_KERNEL, SINGLE_PASS_KERNEL))
def hc_pre_single_pass(streams: torch.Tensor, previous_pre: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                       scale: torch.Tensor, norm_eps: float, hc_eps: float, sinkhorn_iters: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(collapsed with ``previous_pre`` [T, D] in streams.dtype, pre [T, N], post [T, N], comb [T, N, N]; fp32)."""
    index, arch = cuda_target(streams)
    return prepare(streams, previous_pre, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, arch=arch).run(index)

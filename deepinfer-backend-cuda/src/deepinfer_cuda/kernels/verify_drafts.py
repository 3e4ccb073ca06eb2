"""Speculative verification with no host reads: core's coupled ``verify_drafts`` (ops/speculative.py).

Every target row's token is the token plain sampling draws there, so the op is this backend's ``sample_tokens``
over the ``B * (K+1)`` target rows at their output positions (its race kernel and per-row pick: the same noise,
bit for bit, and the same chunked reduction as a plain decode step's draw), then the acceptance in a few torch
ops on ``[B, K+1]`` (core's :func:`~deepinfer.ops.speculative.accept_agreeing`).  No kernel of its own, no host
data, so a captured verify step holds it whole.

A row's token depends only on that row (fixed vocabulary chunks), and the acceptance is per request, so a
request's result never depends on the batch.  Greedy results equal the reference's exactly (fp32 argmax, first
index); a sampled row may differ only where rounding decides a near-tie of its race (the op's compare).
"""

from __future__ import annotations

import torch

from deepinfer.ops.speculative import accept_agreeing, row_draws
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, cuda_target
from deepinfer_cuda.kernels import sample_tokens
from deepinfer_cuda.override import override


def prepare(target: torch.Tensor, greedy: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
            seeds: torch.Tensor, steps: torch.Tensor, *, arch: CudaArch) -> LaunchChain:
    """Plan ``verify_drafts(...)`` for ``arch``: sample_tokens' launch over every target row, then the acceptance
    (in ``finish``); nothing launched."""
    device = target.device
    greedy = greedy.to(device=device, dtype=torch.bool)
    seeds = seeds.to(device=device, dtype=torch.int64)
    steps = steps.to(device=device, dtype=torch.int64)
    drafts = draft_tokens.to(device=device, dtype=torch.int64)
    num_drafts = num_drafts.to(device=device, dtype=torch.int64)
    rows = target.shape[:2]
    draw = sample_tokens.prepare(*row_draws(target.float(), greedy, seeds, steps), arch=arch)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        return accept_agreeing(draw.finish().view(rows), drafts, num_drafts)

    return LaunchChain(draw.steps, finish)


# batch-invariant: sample_tokens' fixed chunks per row (checked on an H200), then per-request torch ops
@override("verify_drafts", batch_invariant=True, aot=(sample_tokens.KERNEL,))
def verify_drafts(target: torch.Tensor, greedy: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                  seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, K+1] int64, num_accepted [B] int64) of fp32 target rows [B, K+1, V]: core's reference op."""
    index, arch = cuda_target(target)
    return prepare(target, greedy, draft_tokens, num_drafts, seeds, steps, arch=arch).run(index)

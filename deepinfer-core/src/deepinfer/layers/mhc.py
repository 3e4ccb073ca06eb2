"""One mHC site's parameters and its pre step (``hc_<site>_fn`` [(2+N)N, N*D], ``_base``, ``_scale`` [3], fp32)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.ops import Ops


@dataclass(slots=True, frozen=True)
class HcSpec:
    """mHC hyperparameters (plain data from the model config)."""

    norm_eps: float  # the unweighted RMSNorm of the flattened streams
    hc_eps: float
    sinkhorn_iters: int


class HyperConnection:
    """One mHC site: V4 collapses its sublayer input with the site's own ``pre`` (:meth:`pre`); V4.1 with the
    previous site's, returning its own for the next (:meth:`pre_single_pass`)."""

    def __init__(self, ops: Ops, spec: HcSpec, get: Callable[[str], torch.Tensor], prefix: str):
        self.ops, self.spec = ops, spec
        self.fn, self.base, self.scale = get(prefix + "_fn"), get(prefix + "_base"), get(prefix + "_scale")

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sublayer input [T, D], post [T, N], comb [T, N, N])."""
        s = self.spec
        return self.ops.hc_pre(streams, self.fn, self.base, self.scale, s.norm_eps, s.hc_eps, s.sinkhorn_iters)

    def pre_single_pass(self, streams: torch.Tensor, previous_pre: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sublayer input collapsed with ``previous_pre``, this site's pre, post, comb)."""
        s = self.spec
        return self.ops.hc_pre_single_pass(streams, previous_pre, self.fn, self.base, self.scale, s.norm_eps,
                                           s.hc_eps, s.sinkhorn_iters)

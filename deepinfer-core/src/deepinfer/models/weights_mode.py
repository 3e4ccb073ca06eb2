"""What a quantized checkpoint's weights become in memory: ``native`` (as stored: FP8 with block scales, MXFP4,
run by the packed ops) or ``dequantize`` (the compute dtype, at load, with no stored copy kept beside).

``DEEPINFER_QUANTIZED_WEIGHTS`` forces either.  Unset, the op table decides: ``native`` where the backend
overrides every packed op (its kernels read the stored bytes: a quarter to half the memory and traffic of bf16),
``dequantize`` where any of them is core's reference, which dequantizes the weight on every call (so the
reference backend would pay that on every step to save memory it does not lack).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deepinfer import envs
from deepinfer.ops import Ops
from deepinfer.ops.table import OpTable

logger = logging.getLogger(__name__)

#: The ops a model whose weights stay as stored runs them with.
PACKED_OPS = ("fp8_block_linear", "fp8_block_grouped_linear", "moe_experts_mxfp4", "moe_experts_fp8")


@dataclass(slots=True, frozen=True)
class WeightsMode:
    """``native``: quantized weights stay as stored; ``reason``: why, for the start-up log line."""

    native: bool
    reason: str

    @property
    def name(self) -> str:
        return "native" if self.native else "dequantize"

    def log(self, checkpoint: object) -> None:
        """Say which, and why, for a checkpoint that has quantized weights."""
        logger.info("quantized weights of %s: %s (%s)", checkpoint, self.name, self.reason)


def mode_for(overridden: frozenset[str] | set[str], backend_name: str) -> WeightsMode:
    """The mode for a backend overriding the ops ``overridden``, unless ``DEEPINFER_QUANTIZED_WEIGHTS`` is set
    (also for planning without building the op table: a backend's ``load_ops()`` keys)."""
    forced = envs.quantized_weights()
    if forced is not None:
        return WeightsMode(forced == "native", f"DEEPINFER_QUANTIZED_WEIGHTS={forced}")
    missing = [op for op in PACKED_OPS if op not in overridden]
    if not missing:
        return WeightsMode(True, f"backend {backend_name!r} has kernels for the stored formats; "
                                 "DEEPINFER_QUANTIZED_WEIGHTS=dequantize for the compute dtype")
    return WeightsMode(False, f"backend {backend_name!r} has no kernel for {', '.join(missing)} (reference ops "
                              "dequantize on every call); DEEPINFER_QUANTIZED_WEIGHTS=native keeps them as stored")


def weights_mode(ops: Ops) -> WeightsMode:
    """The mode for the op table ``ops`` (a plain :class:`~deepinfer.ops.protocol.Ops` has no backend: reference)."""
    if isinstance(ops, OpTable):
        return mode_for(ops.overridden, ops.backend_name)
    return mode_for(frozenset(), "reference")

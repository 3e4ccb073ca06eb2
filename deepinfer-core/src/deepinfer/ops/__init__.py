"""Ops: the unit of acceleration.  See :mod:`deepinfer.ops.registry` and :mod:`deepinfer.ops.table`."""

from deepinfer.ops.catalog import op_defs
from deepinfer.ops.protocol import Ops
from deepinfer.ops.registry import OpDef, OpSample, reference_op
from deepinfer.ops.table import OpTable

__all__ = ["OpDef", "OpSample", "OpTable", "Ops", "op_defs", "reference_op"]

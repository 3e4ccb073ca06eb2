"""Ops: the unit of acceleration.  See :mod:`deepinfer.ops.registry`."""

from deepinfer.ops.registry import OpDef, OpSample, OpTable, op_defs, reference_op

__all__ = ["OpDef", "OpSample", "OpTable", "op_defs", "reference_op"]

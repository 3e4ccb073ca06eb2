"""Every module of core that registers reference ops, loaded: the complete registry the op table is built over.

The list is explicit (no package walk, no import of this package from below it), so the imports show what
registers ops; ``tests/core/ops/test_op_protocol.py`` fails on an op module missing here.
"""

from __future__ import annotations

from types import ModuleType

from deepinfer.ops import (
    attention,
    compress,
    engram,
    fake_quant,
    indexer,
    kv_quant,
    linear,
    mhc,
    moe,
    norm,
    packed_attention,
    packed_indexer,
    quant,
    quant_gemm,
    rope,
    rope_quant,
    sampling,
    speculative,
    structured,
)
from deepinfer.ops.registry import OpDef, registered

#: The modules whose import registers core's ops.
OP_MODULES: tuple[ModuleType, ...] = (
    attention, compress, engram, fake_quant, indexer, kv_quant, linear, mhc, moe, norm, packed_attention,
    packed_indexer, quant, quant_gemm, rope, rope_quant, sampling, speculative, structured,
)


def op_defs() -> dict[str, OpDef]:
    """All of core's ops by name."""
    return registered()

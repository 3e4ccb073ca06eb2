"""What DeepSeek-V4.1-Flash's released checkpoint stores for a config: each tensor's name, stored shape and
safetensors dtype (``docs/models/deepseek_v41.md``, "Loading"; the facts are vLLM's, TensorRT-LLM's and mlx-lm's
loaders of it).  The names are the loader's own (:func:`.weights.expected_shapes`,
:func:`.dspark_weights.expected_mtp_shapes`: written once); this module adds how each is stored:

- FP8 e4m3 with one ue8m0 (``F8_E8M0``) scale per 32 x 32 block: attention's ``wq_a`` / ``wq_b`` / ``wkv`` /
  ``wo_a`` / ``wo_b``, the indexer's ``wq_b``, the shared experts, Engram's ``wkv``, DSpark's ``main_proj``;
- MXFP4: routed experts, two e2m1 codes a byte (``I8``, low nibble first) and one ``F8_E8M0`` scale per 32;
- Engram tables FP8 with one ue8m0 scale per 32 columns of a row;
- F32: the mHC weights, sinks, ``q_norm`` / ``kv_norm``, router biases, Engram's ``q_weight`` / ``k_weight``;
- BF16: everything else (embedding, head, routers, norms, the compressor unless ``compressor_dtype`` says).

Where those loaders disagree (compressor dtype, the confidence head's name), :class:`LayoutOptions` picks.
Used by the synthetic checkpoint of :mod:`deepinfer.testing.released_checkpoint` and by the memory plan when a
checkpoint's shard headers are not at hand (:mod:`deepinfer.engine.plan_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.dspark_weights import expected_mtp_shapes
from deepinfer.models.deepseek_v41.weights import expected_shapes

#: Bytes per element of each safetensors dtype name.
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I64": 8,
               "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
#: The dense FP8 block (rows, columns) and the MXFP4 / Engram-table scale block (columns).
FP8_BLOCK = (32, 32)
SCALE_COLUMNS = 32

_FP8 = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".attn.indexer.wq_b.",
        ".shared_experts.", ".engram.wkv.", ".main_proj.")
_F32 = (".attn_sink", ".q_norm.weight", ".kv_norm.weight", ".gate.bias", ".gate.bias_vl", ".q_weight", ".k_weight")


@dataclass(slots=True, frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: F32, BF16, F8_E4M3, F8_E8M0, I8, ...

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True, frozen=True)
class LayoutOptions:
    """The released variants the sources disagree on."""

    #: ``attn.compressor.wkv`` / ``wgate``: ``BF16``, ``F32`` or ``F8_E4M3`` (with 32 x 32 scales).
    compressor_dtype: str = "BF16"
    #: DSpark's confidence head: ``confidence_head.proj.weight`` (True) or ``confidence_head.weight`` (False).
    confidence_proj: bool = True
    #: Every MoE router also has ``gate.bias_vl`` (image tokens' bias; a text engine ignores it).
    bias_vl: bool = True


def stored_format(name: str, options: LayoutOptions) -> str:
    """How weight ``name`` is stored: ``mxfp4``, ``fp8`` (32 x 32 blocks), ``fp8_rows`` (an Engram table: a scale
    per 32 columns of each row), or a plain safetensors dtype."""
    if ".ffn.experts." in name:
        return "mxfp4"
    if name.endswith("engram.embed.weight"):
        return "fp8_rows"
    if any(p in name for p in _FP8) or (".compressor.w" in name and options.compressor_dtype == "F8_E4M3"):
        return "fp8"
    if ".compressor.w" in name:
        return options.compressor_dtype
    if ".hc_" in name or name.endswith(_F32):
        return "F32"
    return "BF16"


def stored_tensors(name: str, shape: tuple[int, ...], fmt: str) -> list[StoredTensor]:
    """The tensors that store weight ``name`` of dense ``shape`` in format ``fmt`` (the weight, and its scale)."""
    if fmt not in ("mxfp4", "fp8", "fp8_rows"):
        return [StoredTensor(name, shape, fmt)]
    rows, cols = shape
    scale = name.removesuffix(".weight") + ".scale"
    if fmt == "mxfp4":
        return [StoredTensor(name, (rows, cols // 2), "I8"), StoredTensor(scale, (rows, cols // SCALE_COLUMNS),
                                                                          "F8_E8M0")]
    bn, bk = (1, SCALE_COLUMNS) if fmt == "fp8_rows" else FP8_BLOCK
    return [StoredTensor(name, shape, "F8_E4M3"), StoredTensor(scale, (-(-rows // bn), -(-cols // bk)), "F8_E8M0")]


def released_layout(cfg: DeepseekV41Config, options: LayoutOptions | None = None) -> list[StoredTensor]:
    """Every tensor of the released text checkpoint for ``cfg`` (DSpark's ``mtp.*`` included; the vision tower,
    which a text engine never reads, not)."""
    options = options or LayoutOptions()
    dense = expected_shapes(cfg)
    if not options.bias_vl:
        dense = {n: s for n, s in dense.items() if not n.endswith(".gate.bias_vl")}
    for name, shape in expected_mtp_shapes(cfg).items():
        if name.endswith("confidence_head.proj.weight") and not options.confidence_proj:
            name = name.replace("confidence_head.proj.", "confidence_head.")
        dense[name] = shape
        if name.endswith(".ffn.gate.bias") and options.bias_vl:
            dense[name + "_vl"] = shape
    out: list[StoredTensor] = []
    for name, shape in dense.items():
        out += stored_tensors(name, shape, stored_format(name, options))
    return out

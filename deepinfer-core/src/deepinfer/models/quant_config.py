"""``quantization_config`` of a released DeepSeek-V4 or V4.1 checkpoint (which tensors are quantized is read from
the files themselves)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.models.config_fields import Fields


@dataclass(slots=True, frozen=True)
class QuantSpec:
    """The quantization a checkpoint declares: the FP8 weights' block, the scales' format, the routed experts'."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str = "fp8"  # "fp8" or "fp4" (MXFP4) for the routed experts


def quant_spec(f: Fields) -> QuantSpec | None:
    """``f``'s ``quantization_config`` (None: the checkpoint is not quantized); ``expert_dtype`` is read from it,
    else (V4) from ``f`` itself."""
    qc = f.section("quantization_config")
    if qc is None:
        return None
    rows, cols = qc.integers("weight_block_size", lengths=(2,), lo=1) if qc.has("weight_block_size") else (128, 128)
    choices = ("fp8", "fp4")
    where = qc if qc.has("expert_dtype") else f  # V4.1 moved it into the quantization config
    expert_dtype = where.string("expert_dtype", choices=choices) if where.has("expert_dtype") else "fp8"
    return QuantSpec((rows, cols), qc.optional_string("scale_fmt"), expert_dtype)

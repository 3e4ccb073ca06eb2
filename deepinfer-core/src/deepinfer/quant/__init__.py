"""Quantized checkpoint tensors: the stored form, and the quantizers tests and tools build them with."""

from deepinfer.quant.formats import FP8_BLOCK, MXFP4, QuantizedTensor
from deepinfer.quant.quantize import quantize_fp8_block, quantize_mxfp4

__all__ = ["FP8_BLOCK", "MXFP4", "QuantizedTensor", "quantize_fp8_block", "quantize_mxfp4"]

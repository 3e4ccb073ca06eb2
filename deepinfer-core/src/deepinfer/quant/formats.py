"""A checkpoint tensor kept in its stored low-precision form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

FP8_BLOCK = "fp8_block"  # e4m3 data, one scale per (block_n x block_k) block
MXFP4 = "mxfp4"  # e2m1 packed two per byte, one e8m0 scale per 32 columns

#: e2m1 code -> value (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Dequantizers(Protocol):
    """The two ops of the op table (:class:`deepinfer.ops.Ops`) a stored tensor needs to become dense: declared
    here so that the formats sit below the ops that read them."""

    def dequant_fp8_block(self, data: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                          dtype: torch.dtype) -> torch.Tensor: ...

    def dequant_mxfp4(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(slots=True)
class QuantizedTensor:
    """Quantized weight as released: ``data`` and ``scale`` exactly as stored, plus its logical shape.

    Backends with FP8 / FP4 GEMMs read ``data`` and ``scale``; the reference path calls :meth:`dequantize`.
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]  # the dequantized shape
    block: tuple[int, int]  # (rows, columns) one scale covers: (128, 128) for FP8, (1, 32) for MXFP4

    def dequantize(self, ops: Dequantizers, dtype: torch.dtype) -> torch.Tensor:
        """The dense tensor, through the op table so a backend may dequantize on its device."""
        if self.format == FP8_BLOCK:
            return ops.dequant_fp8_block(self.data, self.scale, self.block[0], self.block[1], dtype)
        if self.format == MXFP4:
            return ops.dequant_mxfp4(self.data, self.scale, dtype)
        raise ValueError(f"unknown quantized format {self.format!r}")

    def to(self, device: torch.device) -> QuantizedTensor:
        return QuantizedTensor(self.format, self.data.to(device), self.scale.to(device), self.shape, self.block)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

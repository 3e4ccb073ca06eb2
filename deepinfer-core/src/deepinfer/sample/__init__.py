"""Sampling: turn a step's logits into tokens through the op table (see :mod:`deepinfer.ops.sampling`)."""

from deepinfer.sample.sampler import Sampler, SamplingRow, TokenMaskProvider

__all__ = ["Sampler", "SamplingRow", "TokenMaskProvider"]

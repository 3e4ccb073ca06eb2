"""The shape rules several kernels share, for their coverage predicates (``@override(..., coverage=...)``).

A kernel module declares what its kernel covers with a predicate per op (:mod:`deepinfer_cuda.override`); the op
table runs core's reference for everything else, so a checkpoint with, say, 3 hyper-connection streams runs on this
backend (slower there).  Each predicate takes its op's arguments (the reference's signature, checked when the table
is built) and reads shapes and plain arguments only: it runs before every call.  The kernels' ``prepare`` raise a
ValueError for what their predicate refuses (tools and tests call ``prepare`` directly).  No Triton import here.

The kernels' other ValueErrors are real errors and stay so: an unknown router scoring function (the reference
refuses it too), windows whose shapes do not match (bad input), a split that is no multiple of its tile (a bug in
``arch.py``).
"""

from __future__ import annotations

import torch


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def rope_fits(inv_freq: torch.Tensor, dim: int) -> bool:
    """Every kernel that rotates takes its rope channels as one tile of pairs: a power-of-two count (or none), at most
    half of the row's ``dim`` channels."""
    half = inv_freq.numel()
    return half & (half - 1) == 0 and 2 * half <= dim


def quant_block_fits(block: int, inv_freq: torch.Tensor, dim: int) -> bool:
    """A fused quantizer's blocks in the rotating kernels' epilogue: whole blocks of a power of two in the rope
    channels (and so in the rest), when the row is whole blocks; otherwise nothing is quantized."""
    if not rope_fits(inv_freq, dim) or block < 1:
        return False
    return dim % block != 0 or (is_pow2(block) and (2 * inv_freq.numel()) % block == 0)


def packed_keys_fit(q: torch.Tensor, key_block: int) -> bool:
    """The indexer's packed keys decode as one power-of-two tile of channels (>= 16), in blocks of 16 or 32."""
    dim = q.shape[-1]
    return is_pow2(dim) and dim >= 16 and key_block in (16, 32) and dim % key_block == 0

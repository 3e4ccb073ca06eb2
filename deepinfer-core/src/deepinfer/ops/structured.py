"""Structured-output ops: masking logits with a grammar's allowed-token bitmask.

The bitmask is filled on the CPU by :mod:`deepinfer.structured` (one row per sampled row, xgrammar's
layout) and copied to the device; this op applies it there, before temperature and truncation.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, reference_op


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] → int32 [N, ceil(V/32)] bitmask, bit ``t % 32`` of word ``t // 32`` = token ``t``."""
    rows, vocab = allowed.shape
    width = (vocab + 31) // 32
    bits = torch.zeros(rows, width * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.to(torch.int64)
    words = (bits.view(rows, width, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _bitmask_samples(dtype: torch.dtype, gen: torch.Generator):
    # Vocab sizes: tiny, not a multiple of 32, the real V4 vocabulary (129280) on few rows.
    for rows, vocab in [(3, 40), (5, 1000), (2, 129280)]:
        logits = (3.0 * torch.randn(rows, vocab, generator=gen)).to(dtype)
        allowed = torch.rand(rows, vocab, generator=gen) < 0.3
        allowed[0] = True  # a free request in the batch
        allowed[-1] = False  # a grammar that admits exactly one token
        allowed[-1, int(torch.randint(vocab, (1,), generator=gen))] = True
        yield OpSample((logits, _pack(allowed)), label=f"{rows}x{vocab}")
    # Random words: every bit pattern, sign bit included (negative int32 words).
    vocab = 32 * 7 - 5
    logits = (3.0 * torch.randn(4, vocab, generator=gen)).to(dtype)
    words = torch.randint(-(2**31), 2**31 - 1, (4, 7), generator=gen, dtype=torch.int32)
    yield OpSample((logits, words), label=f"4x{vocab} random words")


@reference_op(sample_inputs=_bitmask_samples, dtypes=(torch.float32, torch.bfloat16), rows=(0, 1))
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf; returns new logits (the input is not modified).

    logits [N, V] float (fp32 from ``compute_logits``; any float dtype works); bitmask [N, ceil(V/32)]
    int32 on the same device, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
    (xgrammar's layout; a free request's row is all ones, i.e. every word is -1).
    Elementwise per row, so batch-invariant.
    """
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != (rows, (vocab + 31) // 32):
        raise ValueError(
            f"bitmask must be int32 [{rows}, {(vocab + 31) // 32}] for logits [{rows}, {vocab}], "
            f"got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift; & 1 keeps the bit either way
    allowed = bits.reshape(rows, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))

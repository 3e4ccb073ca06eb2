"""The ``apply_token_bitmask`` op: xgrammar's bit layout, -inf on disallowed tokens, nothing else touched."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from deepinfer.ops import OpTable
from deepinfer.structured import bitmask_width, token_allowed


def _random_bitmask(rows: int, vocab: int, gen: torch.Generator, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A bool mask [rows, vocab] and its packed int32 form, built bit by bit (no shared code with the op)."""
    allowed = torch.rand(rows, vocab, generator=gen) < density
    words = torch.zeros(rows, bitmask_width(vocab), dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as int32 two's complement
    return allowed, words.to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_exactly_the_disallowed_tokens(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    allowed, bitmask = _random_bitmask(4, vocab, gen, density=0.5)
    bitmask[1] = -1  # every token allowed
    allowed[1] = True
    single = vocab // 2  # one token allowed, in a word whose sign bit may be it
    bitmask[2] = 0
    bitmask[2, single // 32] = torch.tensor(1 << (single % 32), dtype=torch.int64).to(torch.int32)
    allowed[2] = False
    allowed[2, single] = True
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    before = logits.clone()

    out = OpTable().apply_token_bitmask(logits, bitmask)

    assert out.shape == logits.shape and out.dtype == dtype
    assert torch.equal(logits, before), "the op must not modify its input"
    assert torch.equal(out[allowed], logits[allowed]), "allowed logits must pass through bit for bit"
    assert torch.all(out[~allowed] == float("-inf"))
    assert out[2].argmax().item() == single
    for r in range(4):
        for t in (0, vocab - 1, single):
            assert token_allowed(bitmask, r, t) == bool(allowed[r, t])


def test_agrees_with_xgrammar_kernel_including_sign_bit_words():
    gen = torch.Generator().manual_seed(7)
    vocab = 129280 // 16 + 5  # not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, bitmask_width(vocab)), generator=gen, dtype=torch.int32)
    logits = torch.randn(6, vocab, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(OpTable().apply_token_bitmask(logits, bitmask), expected)

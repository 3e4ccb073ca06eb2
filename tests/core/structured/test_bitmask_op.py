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


@pytest.mark.parametrize("vocab, backend", [(8000, "cpu"), (8085, "torch_native")])
def test_agrees_with_xgrammar_including_sign_bit_words(vocab, backend):
    # xgrammar 0.2.9's C++ CPU kernel writes past the end of a row when vocab % 32 != 0, so it is
    # compared only on a whole number of words; its torch implementation covers the ragged tail.
    gen = torch.Generator().manual_seed(7)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, bitmask_width(vocab)), generator=gen, dtype=torch.int32)
    logits = torch.randn(6, vocab, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, backend=backend)
    assert torch.equal(OpTable().apply_token_bitmask(logits, bitmask), expected)


def _xgrammar_torch(logits, bitmask):
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask, backend="torch_native")
    return out


def _reversed_bits(logits, bitmask):
    """A plausible bug: most significant bit first within each word."""
    shifts = 31 - torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(logits), -1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _forgets_last_word(logits, bitmask):
    """A plausible bug: only whole words of 32 tokens are masked, the tail of the vocabulary is not."""
    full = logits.shape[1] // 32 * 32
    out = logits.clone()
    out[:, :full] = OpTable().apply_token_bitmask(logits[:, :full].contiguous(), bitmask[:, : full // 32].contiguous())
    return out


def _backend(impl):
    from deepinfer.backends.cpu import CpuBackend

    class Backend(CpuBackend):
        name = f"bitmask_{impl.__name__.strip('_')}"

        def load_ops(self):
            return {"apply_token_bitmask": impl}

    return Backend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_samples_accept_xgrammar_and_reject_plausible_bugs(dtype):
    from deepinfer.testing import check_op

    assert check_op(_backend(_xgrammar_torch), "apply_token_bitmask", dtype) >= 4
    for buggy in (_reversed_bits, _forgets_last_word):
        with pytest.raises(AssertionError):
            check_op(_backend(buggy), "apply_token_bitmask", dtype)

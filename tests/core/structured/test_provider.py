"""The engine-facing provider: matchers for requests, the step bitmask through the sampler's hook."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer.structured import GrammarMaskProvider, GrammarMatcher, allocate_token_bitmask, grammar_compiler
from tests.support.structured import build_tokenizer


@dataclass(slots=True)
class Row:
    """Stands in for the sampler's ``SamplingRow``: all the provider reads is ``grammar``."""

    grammar: GrammarMatcher | None


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_provider_masks_constrained_rows_and_skips_free_batches(tokenizer):
    vocab = len(tokenizer) + 11
    provider = GrammarMaskProvider(tokenizer, vocab, stop_token_ids=[tokenizer.eos_token_id])
    assert provider.compiler is grammar_compiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    digits = provider.matcher({"regex": "[0-9]{2}"})
    assert provider.token_bitmask([Row(None), Row(None)], vocab, torch.device("cpu")) is None

    mask = provider.token_bitmask([Row(None), Row(digits), Row(None)], vocab, torch.device("cpu"))
    assert mask.dtype == torch.int32 and tuple(mask.shape) == (3, (vocab + 31) // 32)
    assert bool((mask[[0, 2]] == -1).all())
    expected = allocate_token_bitmask(1, vocab)
    digits.fill_bitmask(expected, 0)
    assert torch.equal(mask[1], expected[0])
    allowed = [t for t in range(vocab) if (int(mask[1, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)

    with pytest.raises(ValueError, match=f"compiled for vocab {vocab}"):
        provider.token_bitmask([Row(digits)], vocab - 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"so_args\['regex'\]: invalid regular expression"):
        provider.matcher({"regex": "[0-9"})

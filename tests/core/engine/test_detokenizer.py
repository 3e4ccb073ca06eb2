"""Incremental detokenization equals a full decode; stop strings are found where they first end."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.detokenizer import IncrementalDetokenizer, find_stop
from tests.support.toy_model import toy_tokenizer

TEXTS = [
    "Once upon a time there was a little girl.",
    "Le café est très bon, crème brûlée!",
    "日本語のテキストも少しあります。",
    "mixed: naïve 東京 + 1000 { }",
]


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == text
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters are never split


def test_random_byte_tokens_equal_full_decode_after_flush(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(30)]
        detok = IncrementalDetokenizer(tokenizer, [0], skip_special_tokens=True)
        for t in ids:
            detok.add(t)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert full.startswith(detok.text)  # held back at most an incomplete tail
        detok.flush()
        assert detok.text == full


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for t in ids:
        skip.add(t)
        keep.add(t)
    assert skip.text == "Hello" and keep.text == "<bos>Hello<eos>"


def test_find_stop_earliest_in_new_text():
    assert find_stop("abcSTOPdef", 3, ("STOP",)) is None  # ended before the new text
    assert find_stop("abcSTOP", 2, ("STOP",)) == (3, "STOP")  # spans old and new text
    assert find_stop("xxABxxCD", 6, ("CD", "AB")) == (2, "AB")
    assert find_stop("", 0, ("A",)) is None

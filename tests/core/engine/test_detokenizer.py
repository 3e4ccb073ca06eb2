"""Incremental detokenization equals a full decode; stop strings are found where they first end."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer.engine.llm import load_tokenizer
from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR
from tests.support.toy_model import toy_tokenizer

TEXTS = [
    "Once upon a time there was a little girl.",
    "Le café est très bon, crème brûlée!",
    "日本語のテキストも少しあります。",
    "mixed: naïve 東京 + 1000 { }",
    "emoji 😀🧑‍🚀 and 🇯🇵 split over byte tokens",
]


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


class SlowTokenizer:
    """A tokenizer with only ``decode`` (like a slow, pure-Python one): the detokenizer's Python form serves it."""

    def __init__(self, inner):
        self._inner = inner
        self.eos_token_id = inner.eos_token_id

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=clean_up_tokenization_spaces)


def _metaspace_tokenizer():
    """A Llama-style tokenizer: ``▁`` for spaces, byte fallback tokens (``<0xE6>``) for characters it lacks."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{b:02X}>" for b in range(256)], show_progress=False)
    tok.train_from_iterator(["Once upon a time there was a girl", "the park and the woods"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {
    "byte-level BPE": toy_tokenizer,
    "embedded model": lambda: load_tokenizer(EMBEDDED_MODEL_DIR),
    "metaspace + byte fallback": _metaspace_tokenizer,
}


def _run(tokenizer, prompt, ids, skip=True):
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = [detok.add(t) for t in ids]
    streamed = detok._stream is not None
    pieces.append(detok.flush())
    return streamed, detok.text, pieces


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_decode_stream_gives_the_python_forms_text(name):
    """Same pieces, token by token, through DecodeStream (fast tokenizers) and the Python form (others): on text
    with multi-byte characters split over tokens, and on random ids (broken UTF-8, special tokens, a prompt that
    ends mid-character), where the stream may give up and hand over to the Python form."""
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(1)
    texts = [(tokenizer.encode("Prompt: "), tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]
    noise = [([rng.randrange(len(tokenizer)) for _ in range(rng.randrange(8))],
              [rng.randrange(len(tokenizer)) for _ in range(40)]) for _ in range(30)]
    for prompt, ids in texts + noise:
        for skip in (True, False):
            streamed, text, by_stream = _run(tokenizer, prompt, ids, skip)
            python_streamed, python_text, by_python = _run(SlowTokenizer(tokenizer), prompt, ids, skip)
            assert not python_streamed
            assert by_stream == by_python and text == python_text
            if (prompt, ids) in texts:
                assert streamed  # a fast tokenizer on real text does go through DecodeStream


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

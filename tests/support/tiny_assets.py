"""The tiny models shipped in the package and the story corpus they were trained on (``tools.train.corpus``).

Tests that rely on one architecture name its asset (``TINY_V4_DIR``, ``TINY_V41_DIR``); tests of whatever
``LLM()`` picks use ``deepinfer.engine.model_source.EMBEDDED_MODEL_DIR``.  The asset tests score fresh stories
from the training generator with seeds the training never used."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import deepinfer

ASSETS = Path(deepinfer.__file__).parent / "assets"
TINY_V4_DIR = ASSETS / "tiny_v4"  # DeepSeek-V4 (tools.train.tiny_v4)
TINY_V41_DIR = ASSETS / "tiny_v41"  # DeepSeek-V4.1, the embedded default (tools.train.tiny_v41)


def corpus() -> ModuleType:
    """``tools.train.corpus`` (``build_corpus``, ``pack``, ``PROMPTS``, ...), imported on first use (it loads the
    tokenizer libraries)."""
    from tools.train import corpus

    return corpus


def known_words(stories: int = 2000, seed: int = 7) -> set[str]:
    """The whitespace-separated words (with punctuation) of ``stories`` fresh stories."""
    return set(" ".join(corpus().build_corpus(stories, seed=seed)).split())

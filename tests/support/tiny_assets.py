"""The tiny models shipped in the package and the story corpus they were trained on (tools/tiny_corpus.py).

Tests that rely on one architecture name its asset (``TINY_V4_DIR``, ``TINY_V41_DIR``); tests of whatever
``LLM()`` picks use ``deepinfer.engine.model_source.EMBEDDED_MODEL_DIR``.  The asset tests score fresh stories
from the training generator with seeds the training never used."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

import deepinfer

ASSETS = Path(deepinfer.__file__).parent / "assets"
TINY_V4_DIR = ASSETS / "tiny_v4"  # DeepSeek-V4 (tools/train_tiny_v4.py)
TINY_V41_DIR = ASSETS / "tiny_v41"  # DeepSeek-V4.1, the embedded default (tools/train_tiny_v41.py)
CORPUS_MODULE = Path(__file__).resolve().parents[2] / "tools" / "tiny_corpus.py"


@cache
def corpus() -> ModuleType:
    """tools/tiny_corpus.py as a module (``build_corpus``, ``pack``, ``PROMPTS``, ...)."""
    spec = importlib.util.spec_from_file_location("tiny_corpus", CORPUS_MODULE)
    assert spec is not None and spec.loader is not None, CORPUS_MODULE
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def known_words(stories: int = 2000, seed: int = 7) -> set[str]:
    """The whitespace-separated words (with punctuation) of ``stories`` fresh stories."""
    return set(" ".join(corpus().build_corpus(stories, seed=seed)).split())

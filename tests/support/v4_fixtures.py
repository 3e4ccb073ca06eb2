"""Tiny random DeepSeek-V4 checkpoints saved by transformers (built by ``tools.fixtures.v4_checkpoint``), and
running them in DeepInfer and in HF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tools.fixtures.v4_checkpoint import (
    RELEASED_RATES,
    SMALL,
    build_checkpoint,
    hf_model,
    randomize,
    read_tensors,
    write_checkpoint,
)

__all__ = ["RELEASED_RATES", "SMALL", "build_checkpoint", "build_engine_checkpoint", "hf_logprobs", "hf_model",
           "random_tokens", "randomize", "read_tensors", "single_thread", "write_checkpoint"]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny ops run faster on one thread, and a shared 2-core CI machine then does not thrash.
    Import this fixture into a test module to apply it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_engine_checkpoint(directory: str | Path, config: dict[str, Any], seed: int = 0,
                            vocab_size: int | None = None):
    """``build_checkpoint`` with the toy tokenizer saved beside it, so ``LLM(directory)`` loads both.

    The model's vocab is ``vocab_size`` (default: the tokenizer's length).  Returns ``(directory, hf_model)``.
    """
    from tests.support.toy_model import toy_tokenizer

    tok = toy_tokenizer() if vocab_size is None else toy_tokenizer(vocab_size)
    built = build_checkpoint(directory, {**config, "vocab_size": vocab_size or len(tok)}, seed)
    tok.save_pretrained(directory)
    return built


@torch.no_grad()
def hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probabilities [S, V] of one sequence, the whole sequence in one call."""
    logits = model(tokens[None], use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def random_tokens(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))

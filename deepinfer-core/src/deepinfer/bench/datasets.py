"""Benchmark prompts as token ids of an exact length: random ids, or windows of a text file's tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any


def random_prompts(tokenizer: Any, num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``input_len`` ids drawn uniformly from the vocabulary, special tokens excluded."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num)]


def file_prompts(tokenizer: Any, path: str | Path, num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """``num`` windows of ``input_len`` consecutive tokens of the file's text, at random offsets (the text is
    repeated if it is shorter than one window)."""
    ids = tokenizer.encode(Path(path).read_text(), add_special_tokens=False)
    if not ids:
        raise ValueError(f"{path} holds no text to make prompts from")
    while len(ids) < input_len:
        ids = ids + ids
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - input_len + 1) for _ in range(num)]
    return [list(ids[s : s + input_len]) for s in starts]


def make_prompts(tokenizer: Any, dataset: str, num: int, input_len: int, path: str | None, seed: int
                 ) -> list[list[int]]:
    if dataset == "random":
        return random_prompts(tokenizer, num, input_len, seed)
    if path is None:
        raise ValueError("--dataset file needs --dataset-path")
    return file_prompts(tokenizer, path, num, input_len, seed)

"""Feeding a model directly (no engine; ``deepinfer.testing.model_runs``) and comparing the result with HF's."""

from __future__ import annotations

import torch

from deepinfer.testing.model_runs import run_chunked, run_ragged, run_schedule

__all__ = ["assert_matches_hf", "run_chunked", "run_ragged", "run_schedule"]


def assert_matches_hf(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4, margin: float = 1e-3) -> None:
    """Log-probabilities within ``atol`` everywhere; same argmax wherever HF's top-2 margin exceeds ``margin``."""
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max |logprob - HF| = {diff:.3g} > {atol}"
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    same = actual.argmax(-1) == expected.argmax(-1)
    assert bool(same[clear].all()), f"argmax differs at positions {torch.nonzero(clear & ~same).flatten().tolist()}"

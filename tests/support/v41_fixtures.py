"""The DeepSeek-V4.1 reference fixtures (tests/fixtures/deepseek_v41): transformers main's tiny checkpoints with
teacher-forced log-probabilities (each folder's README says how they were made and what is exact)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v41"


@dataclass(slots=True, frozen=True)
class Reference:
    """One sequence's reference: the token ids, each position's teacher-forced logprob of the next token, and
    the top-5 next tokens with their logprobs."""

    tokens: torch.Tensor  # [S] int64
    token_logprobs: torch.Tensor  # [S - 1]
    top5_ids: torch.Tensor  # [S, 5] (or [S - 1, 5])
    top5_logprobs: torch.Tensor


def _reference(tokens: list[int], ref: dict) -> Reference:
    return Reference(torch.tensor(tokens), torch.tensor(ref["token_logprobs"]), torch.tensor(ref["top5_ids"]),
                     torch.tensor(ref["top5_logprobs"]))


def references(name: str) -> list[Reference]:
    """The fixture's sequences, each run alone in one forward."""
    folder = FIXTURES / name
    sequences = json.loads((folder / "tokens.json").read_text())["sequences"]
    refs = json.loads((folder / "ref_logprobs.json").read_text())["sequences"]
    return [_reference(tokens, ref) for tokens, ref in zip(sequences, refs, strict=True)]


def chunked_reference(name: str) -> tuple[Reference, list[int]]:
    """``ref_logprobs_chunked.json``: one sequence fed through transformers' cache in chunks, and the chunks."""
    folder = FIXTURES / name
    ref = json.loads((folder / "ref_logprobs_chunked.json").read_text())
    tokens = json.loads((folder / "tokens.json").read_text())["sequences"][ref["sequence_index"]]
    return _reference(tokens, ref), ref["chunk_sizes"]


def logprob_errors(logprobs: torch.Tensor, ref: Reference) -> torch.Tensor:
    """|teacher-forced logprob - reference| per position, from log-probabilities [S, V]."""
    got = logprobs[:-1].gather(1, ref.tokens[1:, None]).squeeze(1)
    return (got - ref.token_logprobs).abs()


def assert_matches(logprobs: torch.Tensor, ref: Reference, atol: float = 1e-4) -> None:
    """Every teacher-forced logprob within ``atol``, and the top-5: the same logprobs, the same ids except where
    neighbours are within ``atol`` of each other (a swap is then a rounding decision)."""
    errors = logprob_errors(logprobs, ref)
    worst = float(errors.max())
    assert worst <= atol, f"max |logprob - reference| = {worst:.3g} at position {int(errors.argmax())}"
    rows = ref.top5_ids.shape[0]
    top = logprobs[:rows].topk(5, dim=-1)
    diff = (top.values - ref.top5_logprobs).abs().max()
    assert float(diff) <= atol, f"top-5 logprobs differ by {float(diff):.3g}"
    tied = torch.zeros_like(ref.top5_ids, dtype=torch.bool)
    gaps = (ref.top5_logprobs[:, :-1] - ref.top5_logprobs[:, 1:]).abs() <= atol
    tied[:, :-1] |= gaps
    tied[:, 1:] |= gaps
    mismatch = (top.indices != ref.top5_ids) & ~tied
    assert not bool(mismatch.any()), f"top-5 ids differ at positions {mismatch.any(1).nonzero().flatten().tolist()}"

"""Shared checks for engine tests: ragged workloads with mixed sampling, and output comparison."""

from __future__ import annotations

import random

import torch

from deepinfer import RequestOutput, SamplingParams


def ragged_prompts(vocab: int, count: int = 8, max_len: int = 40, seed: int = 7,
                   lengths: list[int] | None = None) -> list[list[int]]:
    """Random token-id prompts (ids >= 3: no special tokens) of ``lengths``, or ``count`` in 1..max_len."""
    rng = random.Random(seed)
    lengths = lengths or [rng.randint(1, max_len) for _ in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def mixed_params(max_tokens: int) -> list[SamplingParams]:
    """Eight requests: greedy, seeded, filtered, penalised, n=2, min_tokens; all with logprobs."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=11),
        dict(temperature=0.8, top_k=20, seed=12),
        dict(temperature=1.2, top_p=0.9, seed=13),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
        dict(temperature=1.0, min_p=0.05, frequency_penalty=0.4, seed=14),
        dict(temperature=0.7, seed=15, n=2),
        dict(temperature=1.0, seed=16, min_tokens=4),
    ]
    return [SamplingParams(max_tokens=max_tokens, logprobs=3, prompt_logprobs=2, ignore_eos=True, **k) for k in kinds]


def assert_same_output(a: RequestOutput, b: RequestOutput, tol: float = 1e-5,
                       flips: tuple[float, int] | None = None) -> None:
    """Same tokens, finish reasons and ranks; logprobs (prompt and generated) within ``tol``.  ``flips`` = (bound,
    count): up to ``count`` generated positions per completion may differ by up to ``bound`` instead (a model that
    fake-quantizes its KV, V4.1: a rounding difference of another batch shape can move one value across an FP8
    rounding boundary, which shifts the logprobs after it by a few hundredths)."""
    assert a.error is None and b.error is None
    assert a.prompt_token_ids == b.prompt_token_ids
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
        if pa is None:
            assert pb is None
            continue
        assert pa.keys() == pb.keys()
        for t in pa:
            assert abs(pa[t].logprob - pb[t].logprob) < tol and pa[t].rank == pb[t].rank
    assert len(a.outputs) == len(b.outputs)
    bound, count = flips if flips is not None else (tol, 0)
    for ca, cb in zip(a.outputs, b.outputs, strict=True):
        assert ca.token_ids == cb.token_ids
        assert ca.finish_reason == cb.finish_reason and ca.text == cb.text
        assert abs(ca.cumulative_logprob - cb.cumulative_logprob) < max(tol * len(ca.token_ids), count * bound, tol)
        flipped = 0
        for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
            assert la.keys() == lb.keys()
            worst = max((abs(la[t].logprob - lb[t].logprob) for t in la), default=0.0)
            flipped += worst >= tol
            assert worst < bound, f"logprobs differ by {worst:.3g} (bound {bound})"
        assert flipped <= count, f"{flipped} positions differ by more than {tol} (at most {count} may)"


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (all probs > 0)."""
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that two count vectors come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = ((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()
    dof = torch.tensor((keep.sum().item() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))

"""What every step of the runner shares, plain or speculative: the step's rows (:class:`StepPlan`), its traffic
with the device (:class:`StepIO`: index lists up, logprobs back), and the handle the engine gets back
(:class:`StepHandle`).  ``model_runner.py`` and ``speculative.py`` both build on this module, and on nothing of
each other's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.backends import Backend
from deepinfer.ops import Ops
from deepinfer.step import PromptScoring, RunnerOutput, StepInput, TokenLogprobs

#: (rows of the flat batch, a device tensor of tokens, the rows of it to write there).
Feed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class StepHandle:
    """A step queued on the device: its sampled tokens there (one per ``seq_ids`` entry) and ``collect()``,
    which waits for this step's results alone and returns them as plain data."""

    tokens: torch.Tensor | None
    seq_ids: list[int]
    collect: Callable[[], RunnerOutput]

    def rows_of(self, seq_ids: list[int]) -> list[int]:
        """Rows of ``tokens`` holding the tokens of ``seq_ids``."""
        row = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        return [row[s] for s in seq_ids]


@dataclass(slots=True)
class StepPlan:
    """Where the rows of one forward pass go."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[tuple[PromptScoring, int, int]] = field(default_factory=list)  # scoring, position, token
    needed_from: list[int] = field(default_factory=list)  # per chunk: ForwardBatch.needed_from


def plan_step(step: StepInput) -> StepPlan:
    """The flat rows of ``step``: its chunks' tokens in order, the rows that sample (a fork shares its parent's)
    and the prompt rows whose logprobs were asked for."""
    plan = StepPlan(needed_from=list(step.needed_from))
    row = 0
    samples = iter(step.samples)
    for chunk, scoring in zip(step.chunks, step.prompt_scoring or [None] * len(step.chunks), strict=True):
        n = len(chunk.token_ids)
        plan.input_ids += chunk.token_ids
        plan.positions += range(chunk.start, chunk.start + n)
        plan.seq_lens.append(n)
        if scoring is not None:  # row at position p scores prompt token p + 1
            for i, token in enumerate(scoring.token_ids):
                plan.prompt_rows.append(row + scoring.first - chunk.start + i)
                plan.prompt_targets.append((scoring, scoring.first + 1 + i, token))
        if chunk.sample:
            for sid in (chunk.seq_id, *chunk.fork_to):
                sample = next(samples)
                if sample.seq_id != sid:
                    raise ValueError(f"step samples are out of chunk order: {sample.seq_id} where {sid} samples")
                plan.sample_rows.append(row + n - 1)
        row += n
    if next(samples, None) is not None:
        raise ValueError("step has more samples than its chunks sample")
    return plan


def check_states(step: StepInput) -> None:
    """Every chunk starts where its sequence's state ends."""
    for chunk, state in zip(step.chunks, step.states, strict=True):
        if state.num_tokens != chunk.start:
            raise RuntimeError(f"sequence {chunk.seq_id}: state holds {state.num_tokens} tokens, "
                               f"chunk starts at {chunk.start}")


class StepIO:
    """A step's traffic with the model's device, through the backend's copy services: int64 index lists up
    (non-blocking on CUDA), logprobs and ranks back (queued now, read when asked)."""

    __slots__ = ("backend", "device", "ops")

    def __init__(self, backend: Backend, device: torch.device, ops: Ops):
        self.backend, self.device, self.ops = backend, device, ops

    def upload(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device; the host tensor is built here and never touched again."""
        return self.backend.to_device(torch.tensor(values, dtype=torch.int64), self.device)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                 ks: list[int]) -> Callable[[], list[TokenLogprobs]]:
        """Raw-distribution logprob and rank of each chosen token, plus each row's top-``k``: the device work is
        queued now; the returned function reads the results (waiting for this step's copies only)."""
        k_max = max((k or 0 for k in ks), default=0)
        parts = [self.backend.to_host_async(t) for t in (tokens, *self.ops.token_logprobs(logits, tokens, k_max))]

        def read() -> list[TokenLogprobs]:
            tokens_l, lp, rank, top_ids, top_lp = (wait().tolist() for wait in parts)
            return [
                TokenLogprobs(tokens_l[i], lp[i], rank[i],
                              list(zip(top_ids[i][: ks[i] or 0], top_lp[i][: ks[i] or 0], strict=True)))
                for i in range(len(ks))
            ]

        return read

"""The model runner: a ``StepInput`` in, sampled tokens and logprobs out.

It flattens the scheduled chunks into one ``ForwardBatch``, runs the model, computes logits only for
the rows that need them (each sampling sequence's last row, and prompt rows whose logprobs were asked
for), samples, and returns plain Python data.  Device-agnostic: the device is the model's.  It knows the
engine only through the plain step types of ``deepinfer.step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.backends import Backend
from deepinfer.models.base import CausalLM, ForwardBatch, SequenceState
from deepinfer.ops import Ops
from deepinfer.runner.decode_graphs import DecodeGraphs
from deepinfer.runner.draft_graphs import DraftGraphs
from deepinfer.runner.verify_graphs import VerifyGraphs
from deepinfer.sample.sampler import Sampler, TokenMaskProvider
from deepinfer.spec_decode.drafter import Drafter
from deepinfer.step import PLACEHOLDER, PromptScoring, RunnerOutput, ScheduledSample, StepInput, TokenLogprobs

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
class _Plan:
    """Where the rows of one forward pass go."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[tuple[PromptScoring, int, int]] = field(default_factory=list)  # scoring, position, token
    needed_from: list[int] = field(default_factory=list)  # per chunk: ForwardBatch.needed_from


class ModelRunner:
    """Runs one scheduled step of the model and the sampler."""

    def __init__(self, model: CausalLM, sampler: Sampler, ops: Ops, token_masks: TokenMaskProvider | None = None,
                 backend: Backend | None = None, decode_graphs: DecodeGraphs | None = None):
        self.model = model
        self.sampler = sampler
        self.ops = ops
        self.token_masks = token_masks
        self.backend = backend if backend is not None else Backend()  # the base class: plain ``t.to(device)``
        #: Replays pure-decode steps (every chunk one token) from captured graphs; None = always eager.
        self.decode_graphs = decode_graphs
        #: Speculative decoding's drafter (set by the engine); every step then runs ``launch_speculative``.
        self.drafter: Drafter | None = None
        #: Replays the drafter's greedy draft passes from captured graphs (set with the drafter when the engine
        #: captures decode steps and the drafter is a ``GraphDrafter``); None = drafts run eagerly.
        self.draft_graphs: DraftGraphs | None = None
        #: Replays pure-decode speculative steps as captured verify steps (set by the engine where the model is
        #: ``VerifyDecodable`` and decode steps are captured); None = every speculative step runs eagerly.
        self.verify_graphs: VerifyGraphs | None = None
        #: Benchmarks only (``tools/bench_dspark.py``): a mean acceptance length L (tokens per verify step); each
        #: step then accepts L - 1 drafts (alternating floor and ceil) whatever the target says.  Lossy.
        self.forced_acceptance: float | None = None
        self.forced_steps = 0

    def _upload(self, values: list[int]) -> torch.Tensor:
        """A step's int64 ids / positions / row indices on the model's device, by the backend's copy service
        (non-blocking on CUDA); the host tensor is built here and never touched again."""
        return self.backend.to_device(torch.tensor(values, dtype=torch.int64), self.model.device)

    def _plan(self, step: StepInput) -> _Plan:
        plan = _Plan(needed_from=list(step.needed_from))
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

    def launch(self, step: StepInput, previous: StepHandle | None = None) -> StepHandle:
        """Queue one step on the device without waiting for it.  Tokens scheduled as ``PLACEHOLDER`` (sampled
        by ``previous``, not yet read by the host) are taken from ``previous``'s device tensor."""
        if self.drafter is not None:
            from deepinfer.runner.speculative import launch_speculative

            return launch_speculative(self, step)
        plan = self._plan(step)
        device = self.model.device
        for chunk, state in zip(step.chunks, step.states, strict=True):
            if state.num_tokens != chunk.start:
                raise RuntimeError(f"sequence {chunk.seq_id}: state holds {state.num_tokens} tokens, "
                                   f"chunk starts at {chunk.start}")
        logits_of = self._forward(plan, step.states, self._feed(plan, step, previous))
        prompt_results = sampled_results = None
        tokens = None
        if plan.prompt_rows:
            logits = logits_of(plan.prompt_rows)
            targets = self._upload([t for _, _, t in plan.prompt_targets])
            prompt_results = self._logprobs(logits, targets, [sc.num_logprobs for sc, _, _ in plan.prompt_targets])
        if plan.sample_rows:
            # Forks share their parent's row: compute its logits once and index them per sample.
            unique = sorted(set(plan.sample_rows))
            logits = logits_of(unique)
            if plan.sample_rows != unique:
                where = {r: i for i, r in enumerate(unique)}
                logits = logits[self._upload([where[r] for r in plan.sample_rows])]
            rows = [s.row for s in step.samples]
            bitmask = self.token_masks.token_bitmask(rows, logits.shape[-1], device) if self.token_masks else None
            tokens = self.sampler(logits, rows, bitmask, self._inflight_tokens(step.samples, previous))
            sampled_results = self._logprobs(logits, tokens, [r.params.logprobs or 0 for r in rows])

        def collect() -> RunnerOutput:
            out = RunnerOutput()
            if prompt_results is not None:
                for (scoring, pos, _), tl in zip(plan.prompt_targets, prompt_results(), strict=True):
                    out.prompt_logprobs.append((scoring.seq_id, pos, tl))
            if sampled_results is not None:
                for sample, tl in zip(step.samples, sampled_results(), strict=True):
                    out.sampled.append((sample.seq_id, tl))
            return out

        return StepHandle(tokens, [s.seq_id for s in step.samples], collect)

    def _forward(self, plan: _Plan, batch_states: list[SequenceState],
                 feed: Feed | None) -> Callable[[list[int]], torch.Tensor]:
        """Run the model on the step; returns ``logits_of(rows)`` (fp32 logits of those flat-batch rows).  A
        step whose chunks are all one token replays a decode graph, whose logits cover every row."""
        input_ids = [max(t, 0) for t in plan.input_ids] if feed is not None else plan.input_ids
        if self.decode_graphs is not None and all(n == 1 for n in plan.seq_lens):
            step_logits = self.decode_graphs.run(batch_states, input_ids, feed)

            def logits_of(rows: list[int]) -> torch.Tensor:
                if rows == list(range(len(rows))):  # every row in order (a plain decode step): no gather
                    return step_logits[: len(rows)]
                return step_logits[self._upload(rows)]

            return logits_of
        ids = self._upload(input_ids)
        if feed is not None:
            ids[feed[0]] = feed[1][feed[2]]
        hidden = self.model.forward(ForwardBatch(
            input_ids=ids,
            positions=self._upload(plan.positions),
            seq_lens=plan.seq_lens,
            states=batch_states,
            to_device=self.backend.to_device,
            needed_from=plan.needed_from or None,
        ))
        return lambda rows: self.model.compute_logits(hidden[self._upload(rows)])

    def _inflight_tokens(self, samples: list[ScheduledSample],
                         previous: StepHandle | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sample rows, their in-flight token on the device) for sequences whose last token is not read yet."""
        rows = [i for i, sample in enumerate(samples) if sample.inflight]
        if not rows:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a sampled row has an in-flight token but no previous step to take it from")
        owners = previous.rows_of([samples[i].seq_id for i in rows])
        return self._upload(rows), previous.tokens[self._upload(owners)]

    def _feed(self, plan: _Plan, step: StepInput, previous: StepHandle | None) -> Feed | None:
        """(rows of the flat batch, the previous step's token tensor, its rows) for every placeholder token."""
        dst = [i for i, t in enumerate(plan.input_ids) if t == PLACEHOLDER]
        if not dst:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step has in-flight tokens but no previous step to take them from")
        owners = [chunk.seq_id for chunk in step.chunks for t in chunk.token_ids if t == PLACEHOLDER]
        return self._upload(dst), previous.tokens, self._upload(previous.rows_of(owners))

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
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

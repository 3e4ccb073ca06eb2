"""The model runner: a ``SchedulerOutput`` in, sampled tokens and logprobs out.

It flattens the scheduled chunks into one ``ForwardBatch``, runs the model, computes logits only for
the rows that need them (each sampling sequence's last row, and prompt rows whose logprobs were asked
for), samples, and returns plain Python data.  Device-agnostic: the device is the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deepinfer.backends import Backend
from deepinfer.engine.request import Request, Sequence
from deepinfer.engine.scheduler import PLACEHOLDER, SchedulerOutput
from deepinfer.engine.state_cache import StateCache
from deepinfer.models.base import CausalLM, ForwardBatch
from deepinfer.ops import Ops
from deepinfer.runner.decode_graphs import DecodeGraphs
from deepinfer.sample.sampler import Sampler, SamplingRow, TokenMaskProvider


@dataclass(slots=True)
class TokenLogprobs:
    """A chosen token with its raw logprob and rank, and the top alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    #: One per sampled row, in chunk order (a forking chunk samples its parent, then each fork).
    sampled: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    #: Prompt logprobs computed this step: (request, position of the scored token, its logprobs).
    prompt_logprobs: list[tuple[Request, int, TokenLogprobs]] = field(default_factory=list)


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
    sample_seqs: list[Sequence] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[tuple[Request, int, int]] = field(default_factory=list)  # request, position, token
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

    def _upload(self, values: list[int]) -> torch.Tensor:
        """A step's int64 ids / positions / row indices on the model's device, by the backend's copy service
        (non-blocking on CUDA); the host tensor is built here and never touched again."""
        return self.backend.to_device(torch.tensor(values, dtype=torch.int64), self.model.device)

    def _plan(self, sched: SchedulerOutput, seqs: Mapping[int, Sequence]) -> _Plan:
        plan = _Plan()
        row = 0
        for chunk in sched.chunks:
            seq = seqs[chunk.seq_id]
            n = len(chunk.token_ids)
            plan.input_ids += chunk.token_ids
            plan.positions += range(chunk.start, chunk.start + n)
            plan.seq_lens.append(n)
            req = seq.request
            plan.needed_from.append(seq.num_tokens - 1)  # the last known token's row gives the next token
            if seq.index == 0 and req.wants_prompt_logprobs:
                # Row at position p scores prompt token p + 1; resume where earlier steps stopped.
                first = max(chunk.start, len(req.prompt_logprobs) - 1)
                plan.needed_from[-1] = max(len(req.prompt_logprobs) - 1, 0)
                for p in range(first, min(chunk.start + n, req.prompt_len - 1)):
                    plan.prompt_rows.append(row + p - chunk.start)
                    plan.prompt_targets.append((req, p + 1, req.prompt_token_ids[p + 1]))
            if chunk.sample:
                for sid in (chunk.seq_id, *chunk.fork_to):
                    plan.sample_rows.append(row + n - 1)
                    plan.sample_seqs.append(seqs[sid])
            row += n
        return plan

    def launch(self, sched: SchedulerOutput, seqs: Mapping[int, Sequence], states: StateCache,
               previous: StepHandle | None = None) -> StepHandle:
        """Queue one step on the device without waiting for it.  Tokens scheduled as ``PLACEHOLDER`` (sampled
        by ``previous``, not yet read by the host) are taken from ``previous``'s device tensor."""
        plan = self._plan(sched, seqs)
        device = self.model.device
        batch_states = []
        for chunk in sched.chunks:
            state = states.get(chunk.seq_id)
            if state.num_tokens != chunk.start:
                raise RuntimeError(f"sequence {chunk.seq_id}: state holds {state.num_tokens} tokens, "
                                   f"chunk starts at {chunk.start}")
            batch_states.append(state)
        logits_of = self._forward(plan, batch_states, self._feed(plan, sched, previous))
        prompt_results = sampled_results = None
        tokens = None
        if plan.prompt_rows:
            logits = logits_of(plan.prompt_rows)
            targets = self._upload([t for _, _, t in plan.prompt_targets])
            ks = [req.params.prompt_logprobs for req, _, _ in plan.prompt_targets]
            prompt_results = self._logprobs(logits, targets, ks)
        if plan.sample_rows:
            # Forks share their parent's row: compute its logits once and index them per sample.
            unique = sorted(set(plan.sample_rows))
            logits = logits_of(unique)
            if plan.sample_rows != unique:
                where = {r: i for i, r in enumerate(unique)}
                logits = logits[self._upload([where[r] for r in plan.sample_rows])]
            rows = [self._sampling_row(s) for s in plan.sample_seqs]
            bitmask = self.token_masks.token_bitmask(rows, logits.shape[-1], device) if self.token_masks else None
            tokens = self.sampler(logits, rows, bitmask, self._inflight_tokens(plan.sample_seqs, previous))
            ks = [s.request.params.logprobs or 0 for s in plan.sample_seqs]
            sampled_results = self._logprobs(logits, tokens, ks)

        def collect() -> RunnerOutput:
            out = RunnerOutput()
            if prompt_results is not None:
                for (req, pos, _), tl in zip(plan.prompt_targets, prompt_results(), strict=True):
                    out.prompt_logprobs.append((req, pos, tl))
            if sampled_results is not None:
                for seq, tl in zip(plan.sample_seqs, sampled_results(), strict=True):
                    out.sampled.append((seq.seq_id, tl))
            return out

        return StepHandle(tokens, [s.seq_id for s in plan.sample_seqs], collect)

    def _forward(self, plan: _Plan, batch_states: list, feed) -> Callable[[list[int]], torch.Tensor]:
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
            needed_from=plan.needed_from,
        ))
        return lambda rows: self.model.compute_logits(hidden[self._upload(rows)])

    def _inflight_tokens(self, seqs: list[Sequence], previous: StepHandle | None):
        """(sample rows, their in-flight token on the device) for sequences whose last token is not read yet."""
        rows = [i for i, seq in enumerate(seqs) if seq.num_inflight]
        if not rows:
            return None
        return self._upload(rows), previous.tokens[self._upload(previous.rows_of([seqs[i].seq_id for i in rows]))]

    def _feed(self, plan: _Plan, sched: SchedulerOutput, previous: StepHandle | None):
        """(rows of the flat batch, the previous step's token tensor, its rows) for every placeholder token."""
        dst = [i for i, t in enumerate(plan.input_ids) if t == PLACEHOLDER]
        if not dst:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step has in-flight tokens but no previous step to take them from")
        owners = [chunk.seq_id for chunk in sched.chunks for t in chunk.token_ids if t == PLACEHOLDER]
        return self._upload(dst), previous.tokens, self._upload(previous.rows_of(owners))

    @staticmethod
    def _sampling_row(seq: Sequence) -> SamplingRow:
        # The output position being sampled counts a token still in flight (async scheduling).
        return SamplingRow(seq.request.params, seq.seed, seq.num_output + seq.num_inflight,
                           seq.request.prompt_token_ids, seq.output_ids, seq.grammar)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                  ks: list[int | None]) -> Callable[[], list[TokenLogprobs]]:
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

"""The model runner: a ``StepInput`` in, sampled tokens and logprobs out.

It flattens the scheduled chunks into one ``ForwardBatch``, runs the model, computes logits only for
the rows that need them (each sampling sequence's last row, and prompt rows whose logprobs were asked
for), samples, and returns plain Python data.  Device-agnostic: the device is the model's.  It knows the
engine only through the plain step types of ``deepinfer.step``.

It owns its execution modes: eager steps, pure-decode steps replayed from captured graphs
(``decode_graphs.py``, unless built without :class:`GraphLimits`), and with a drafter
(:meth:`ModelRunner.set_drafter`) speculative steps (``speculative.py``), whose draft passes and pure-decode verify
steps it captures too where the drafter and the model allow (``draft_graphs.py``, ``verify_graphs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.backends import Backend
from deepinfer.models.base import CausalLM, ForwardBatch, GraphDecodable, SequenceState, VerifyDecodable
from deepinfer.ops import Ops
from deepinfer.runner.decode_graphs import DecodeGraphs
from deepinfer.runner.draft_graphs import DraftGraphs
from deepinfer.runner.speculative import SpeculativeRunner, launch_speculative
from deepinfer.runner.step_plan import Feed, StepHandle, StepIO, StepPlan, check_states, plan_step
from deepinfer.runner.verify_graphs import VerifyGraphs
from deepinfer.sample.sampler import Sampler, TokenMaskProvider
from deepinfer.spec_decode.drafter import Drafter, GraphDrafter, VerifyExtender
from deepinfer.spec_decode.verify import ForcedAcceptance
from deepinfer.step import PLACEHOLDER, RunnerOutput, ScheduledSample, StepInput


@dataclass(slots=True, frozen=True)
class GraphLimits:
    """The shapes captured steps are padded within: ``max_seqs`` sequences a step, ``max_tokens`` tokens a
    sequence (the engine's ``max_num_seqs`` and ``max_model_len``)."""

    max_seqs: int
    max_tokens: int


class ModelRunner:
    """Runs one scheduled step of the model and the sampler.

    ``graphs``: capture pure-decode steps within these limits (the model must be ``GraphDecodable``); None:
    every step runs eagerly (``enforce_eager``).
    """

    def __init__(self, model: CausalLM, sampler: Sampler, ops: Ops, token_masks: TokenMaskProvider | None = None,
                 backend: Backend | None = None, graphs: GraphLimits | None = None):
        self._model = model
        self._sampler = sampler
        self._token_masks = token_masks
        backend = backend if backend is not None else Backend()  # the base class: plain ``t.to(device)``
        self._io = StepIO(backend, model.device, ops)
        self._limits = graphs
        self._decode_graphs: DecodeGraphs | None = None
        if graphs is not None and isinstance(model, GraphDecodable):
            self._decode_graphs = DecodeGraphs(model, backend, model.device, graphs.max_seqs, graphs.max_tokens)
        self._draft_graphs: DraftGraphs | None = None
        self._verify_graphs: VerifyGraphs | None = None
        self._speculative: SpeculativeRunner | None = None

    # --- what it runs with (read-only) ----------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The device services: copies, graph capture."""
        return self._io.backend

    @property
    def drafter(self) -> Drafter | None:
        """Speculative decoding's drafter (:meth:`set_drafter`); every step then runs speculatively."""
        return self._speculative.drafter if self._speculative is not None else None

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The captured pure-decode steps; None: every step runs eagerly."""
        return self._decode_graphs

    @property
    def draft_graphs(self) -> DraftGraphs | None:
        """The captured draft passes of the last ``GraphDrafter`` while decode steps are captured (kept while
        speculation is off, so setting the same drafter again captures nothing again); None: drafts run eagerly."""
        return self._draft_graphs

    @property
    def verify_graphs(self) -> VerifyGraphs | None:
        """The captured verify steps of pure-decode speculative steps (a ``VerifyDecodable`` model whose decode
        steps are captured, once a drafter was set); None: every speculative step runs eagerly."""
        return self._verify_graphs

    # --- execution modes --------------------------------------------------------------------------------------
    def set_token_masks(self, token_masks: TokenMaskProvider | None) -> None:
        """The grammar masks of structured-output rows (built by the engine when a request first needs one)."""
        self._token_masks = token_masks

    def set_drafter(self, drafter: Drafter | None, *, forced_acceptance: float | None = None) -> None:
        """Run every later step speculatively with ``drafter`` (None: plain steps).  Draft passes are captured
        where decode steps are and the drafter is a ``GraphDrafter``; pure-decode verify steps where decode steps
        are and the model is ``VerifyDecodable`` (extending a ``VerifyExtender`` drafter inside the graph).
        ``forced_acceptance``: benchmarks only (lossy), a mean acceptance length L: each step accepts L - 1
        drafts on average whatever the target says (:class:`~deepinfer.spec_decode.verify.ForcedAcceptance`)."""
        if drafter is None:
            if forced_acceptance is not None:
                raise ValueError("forced_acceptance needs a drafter")
            self._speculative = None
            return
        forced = ForcedAcceptance(forced_acceptance) if forced_acceptance is not None else None
        self._speculative = SpeculativeRunner(self._model, self._sampler, self._io, drafter,
                                              self._capture_drafts(drafter), self._capture_verify(drafter), forced)

    def _capture_drafts(self, drafter: Drafter) -> DraftGraphs | None:
        if self._limits is None or self._decode_graphs is None or not isinstance(drafter, GraphDrafter):
            return None
        if self._draft_graphs is None or self._draft_graphs.drafter is not drafter:
            if self._draft_graphs is not None:
                self._draft_graphs.close()
            self._draft_graphs = DraftGraphs(drafter, self.backend, self._model.device, self._limits.max_seqs)
        return self._draft_graphs

    def _capture_verify(self, drafter: Drafter) -> VerifyGraphs | None:
        model = self._model
        if self._limits is None or self._decode_graphs is None or not isinstance(model, VerifyDecodable):
            return None
        extender = drafter if isinstance(drafter, VerifyExtender) else None
        if self._verify_graphs is None or self._verify_graphs.extender is not extender:
            if self._verify_graphs is not None:
                self._verify_graphs.close()
            self._verify_graphs = VerifyGraphs(model, self.backend, model.device, self._limits.max_seqs,
                                               self._limits.max_tokens, extender)
        return self._verify_graphs

    def launch(self, step: StepInput, previous: StepHandle | None = None) -> StepHandle:
        """Queue one step on the device without waiting for it.  Tokens scheduled as ``PLACEHOLDER`` (sampled
        by ``previous``, not yet read by the host) are taken from ``previous``'s device tensor."""
        if self._speculative is not None:
            return launch_speculative(self._speculative, step, self._token_masks)
        plan = plan_step(step)
        device = self._model.device
        check_states(step)
        logits_of = self._forward(plan, step.states, self._feed(plan, step, previous))
        prompt_results = sampled_results = None
        tokens = None
        if plan.prompt_rows:
            logits = logits_of(plan.prompt_rows)
            targets = self._io.upload([t for _, _, t in plan.prompt_targets])
            prompt_results = self._io.logprobs(logits, targets, [sc.num_logprobs for sc, _, _ in plan.prompt_targets])
        if plan.sample_rows:
            # Forks share their parent's row: compute its logits once and index them per sample.
            unique = sorted(set(plan.sample_rows))
            logits = logits_of(unique)
            if plan.sample_rows != unique:
                where = {r: i for i, r in enumerate(unique)}
                logits = logits[self._io.upload([where[r] for r in plan.sample_rows])]
            rows = [s.row for s in step.samples]
            bitmask = self._token_masks.token_bitmask(rows, logits.shape[-1], device) if self._token_masks else None
            tokens = self._sampler(logits, rows, bitmask, self._inflight_tokens(step.samples, previous))
            sampled_results = self._io.logprobs(logits, tokens, [r.params.logprobs or 0 for r in rows])

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

    def _forward(self, plan: StepPlan, batch_states: list[SequenceState],
                 feed: Feed | None) -> Callable[[list[int]], torch.Tensor]:
        """Run the model on the step; returns ``logits_of(rows)`` (fp32 logits of those flat-batch rows).  A
        step whose chunks are all one token replays a decode graph, whose logits cover every row."""
        input_ids = [max(t, 0) for t in plan.input_ids] if feed is not None else plan.input_ids
        if self._decode_graphs is not None and all(n == 1 for n in plan.seq_lens):
            step_logits = self._decode_graphs.run(batch_states, input_ids, feed)

            def logits_of(rows: list[int]) -> torch.Tensor:
                if rows == list(range(len(rows))):  # every row in order (a plain decode step): no gather
                    return step_logits[: len(rows)]
                return step_logits[self._io.upload(rows)]

            return logits_of
        ids = self._io.upload(input_ids)
        if feed is not None:
            ids[feed[0]] = feed[1][feed[2]]
        hidden = self._model.forward(ForwardBatch(
            input_ids=ids,
            positions=self._io.upload(plan.positions),
            seq_lens=plan.seq_lens,
            states=batch_states,
            to_device=self.backend.to_device,
            needed_from=plan.needed_from or None,
        ))
        return lambda rows: self._model.compute_logits(hidden[self._io.upload(rows)])

    def _inflight_tokens(self, samples: list[ScheduledSample],
                         previous: StepHandle | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sample rows, their in-flight token on the device) for sequences whose last token is not read yet."""
        rows = [i for i, sample in enumerate(samples) if sample.inflight]
        if not rows:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a sampled row has an in-flight token but no previous step to take it from")
        owners = previous.rows_of([samples[i].seq_id for i in rows])
        return self._io.upload(rows), previous.tokens[self._io.upload(owners)]

    def _feed(self, plan: StepPlan, step: StepInput, previous: StepHandle | None) -> Feed | None:
        """(rows of the flat batch, the previous step's token tensor, its rows) for every placeholder token."""
        dst = [i for i, t in enumerate(plan.input_ids) if t == PLACEHOLDER]
        if not dst:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step has in-flight tokens but no previous step to take them from")
        owners = [chunk.seq_id for chunk in step.chunks for t in chunk.token_ids if t == PLACEHOLDER]
        return self._io.upload(dst), previous.tokens, self._io.upload(previous.rows_of(owners))

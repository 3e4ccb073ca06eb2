"""A step with a drafter: draft, feed the drafts after each anchor in one target forward, verify, undo the rest.

1. The drafter proposes ``chunk.num_drafts`` tokens per speculating sequence (from its context, which holds the
   target features of every position the sequence has had accepted), as a replayed captured draft pass when the
   runner captures them (:class:`~deepinfer.runner.draft_graphs.DraftGraphs`; greedy and sampled requests alike:
   sampled drafts race the counter-based noise of the request's (seed, output position) that the verifier uses).
   A grammar keeps the leading drafts it allows.
2. One ragged forward runs every chunk with its drafts appended (the model already takes several tokens per
   sequence); states of speculating sequences are checkpointed first (:class:`~deepinfer.models.base.Rewindable`).
3. :func:`deepinfer.spec_decode.verify.verify` accepts a prefix of each sequence's drafts and draws its own token.
4. A sequence whose drafts were all accepted keeps the forward; any other is restored to before it, and its
   accepted tokens are fed again with its next chunk (exact by construction: feeding tokens whole or in chunks
   leaves the same state), or at once when that chunk was itself a re-feed (:func:`_undo`: bounded chunks).  The
   drafter's context is extended with the accepted positions' target features.

A pure-decode step (every chunk its anchor alone) on a model with captured verify steps
(:class:`~deepinfer.runner.verify_graphs.VerifyGraphs`) replaces 2 and 4: one replayed fixed-shape forward of
anchor and drafts, then the model keeps each sequence's accepted rows (``commit_verify``); nothing is undone, and
a :class:`~deepinfer.spec_decode.drafter.VerifyExtender` drafter's context was extended inside the replayed step.

The step is read back before it returns (acceptance decides what the next step feeds), so the engine does not
overlap speculative steps with the next schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from deepinfer.models.base import CausalLM, ForwardBatch, Rewindable, SequenceState, StateCheckpoint
from deepinfer.runner.draft_graphs import DraftGraphs
from deepinfer.runner.step_plan import StepHandle, StepIO, check_states, plan_step
from deepinfer.runner.verify_graphs import VerifyGraphs
from deepinfer.sample.sampler import Sampler, TokenMaskProvider
from deepinfer.spec_decode.drafter import Drafter, DraftRequest, Drafts
from deepinfer.spec_decode.verify import ForcedAcceptance, forced, grammar_rows, verify, verify_rows
from deepinfer.step import RunnerOutput, ScheduledSample, SpecResult, StepInput, TokenLogprobs

#: ``logits_of(rows)``: fp32 logits of those rows of the step's forward.
LogitsOf = Callable[[list[int]], torch.Tensor]


@dataclass(slots=True)
class SpeculativeRunner:
    """What the model runner's speculative steps run with (:meth:`ModelRunner.set_drafter
    <deepinfer.runner.model_runner.ModelRunner.set_drafter>` builds it): the runner's model, sampler and step I/O,
    the drafter, the captured draft passes and verify steps it replays (None: eager), and the benchmarks' forced
    acceptance (None: the verifier decides)."""

    model: CausalLM
    sampler: Sampler
    io: StepIO
    drafter: Drafter
    draft_graphs: DraftGraphs | None = None
    verify_graphs: VerifyGraphs | None = None
    forced: ForcedAcceptance | None = None


@dataclass(slots=True)
class _Spec:
    """One speculating chunk: its index, sample, its row of the drafter's output, how many drafts it verifies
    (after the grammar's cut), their values on the host when they were read, and its grammar masks."""

    chunk: int
    sample: ScheduledSample
    index: int
    count: int
    drafts: list[int] | None = None
    mask: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)  # its target rows in the flat batch
    emitted: list[int] = field(default_factory=list)  # the tokens it got (accepted drafts, then its own)
    confidence: list[float] = field(default_factory=list)  # the drafter's, every drafted position


def _chunk_samples(step: StepInput) -> list[list[ScheduledSample]]:
    samples = iter(step.samples)
    return [[next(samples) for _ in range(1 + len(c.fork_to))] if c.sample else [] for c in step.chunks]


def _draft(runner: SpeculativeRunner, step: StepInput, per_chunk: list[list[ScheduledSample]]
           ) -> tuple[list[_Spec], Drafts | None]:
    """The speculating chunks and the drafter's output (tokens clamped into the vocabulary).  The drafts stay on
    the device unless a grammar or a penalty needs their values (one read for the step)."""
    chosen = [i for i, c in enumerate(step.chunks) if c.num_drafts]
    if not chosen:
        return [], None
    vocab = runner.model.vocab_size
    requests = []
    for i in chosen:
        chunk, row = step.chunks[i], per_chunk[i][0].row
        position = chunk.start + len(chunk.token_ids) - 1
        requests.append(DraftRequest(step.states[i], chunk.token_ids[-1], position,
                                     0.0 if row.params.greedy else row.params.temperature, row.seed, row.step))
    k_max = max(step.chunks[i].num_drafts for i in chosen)
    graphs = runner.draft_graphs
    drafts = graphs.run(requests, k_max) if graphs is not None else runner.drafter.draft(requests, k_max)
    drafts.tokens = drafts.tokens[:, :k_max].clamp(0, vocab - 1)
    specs = [_Spec(i, per_chunk[i][0], n, step.chunks[i].num_drafts) for n, i in enumerate(chosen)]
    wanted = [s for s in specs if s.sample.row.grammar is not None or s.sample.row.params.has_penalties]
    if wanted:
        tokens = drafts.tokens.tolist()
        for s in wanted:
            s.drafts = tokens[s.index][: s.count]
            if s.sample.row.grammar is not None:
                mask, allowed = grammar_rows(s.sample.row.grammar, s.drafts, vocab)
                s.drafts, s.mask, s.count = s.drafts[:allowed], mask[: allowed + 1], allowed
    return specs, drafts


def launch_speculative(runner: SpeculativeRunner, step: StepInput, token_masks: TokenMaskProvider | None
                       ) -> StepHandle:
    """Run ``step`` with drafts (see the module docstring); the returned handle's results are already read.
    ``token_masks``: the grammar masks of structured-output rows."""
    model = runner.model
    check_states(step)
    per_chunk = _chunk_samples(step)
    specs, drafts = _draft(runner, step, per_chunk)
    graphs = runner.verify_graphs
    if graphs is not None and specs and _decode_only(step, per_chunk) and \
            1 + max(s.count for s in specs) <= graphs.model.max_verify_rows:
        return _launch_verify_step(runner, graphs, step, per_chunk, specs, drafts, token_masks)
    counts = {s.chunk: s.count for s in specs}
    chunks = [replace(c, token_ids=c.token_ids + [0] * counts.get(i, 0)) for i, c in enumerate(step.chunks)]
    plan = plan_step(replace(step, chunks=chunks))
    offsets = [0]
    for n in plan.seq_lens:
        offsets.append(offsets[-1] + n)
    for s in specs:
        last = offsets[s.chunk] + len(step.chunks[s.chunk].token_ids) - 1
        s.rows = list(range(last, last + s.count + 1))
    ids = runner.io.upload(plan.input_ids)
    checkpoint: StateCheckpoint | None = None
    if specs:
        assert drafts is not None and isinstance(model, Rewindable)
        dst = [r for s in specs for r in s.rows[1:]]
        src = [s.index * drafts.tokens.shape[1] + j for s in specs for j in range(s.count)]
        if dst:  # the drafts go into the batch on the device
            ids[runner.io.upload(dst)] = drafts.tokens.flatten()[runner.io.upload(src)]
        device = model.device
        checkpoint = model.checkpoint([step.states[s.chunk] for s in specs],
                                      [len(chunks[s.chunk].token_ids) for s in specs],
                                      lambda t: runner.io.backend.to_device(t, device))
    capture = bool(runner.drafter.capture_layer_ids)
    batch = ForwardBatch(ids, runner.io.upload(plan.positions), plan.seq_lens, step.states,
                         to_device=runner.io.backend.to_device, needed_from=plan.needed_from or None,
                         capture_rows=runner.io.upload(list(range(len(plan.input_ids)))) if capture else None)
    hidden = model.forward(batch)

    out = RunnerOutput()
    if plan.prompt_rows:
        logits = model.compute_logits(hidden[runner.io.upload(plan.prompt_rows)])
        targets = runner.io.upload([t for _, _, t in plan.prompt_targets])
        read = runner.io.logprobs(logits, targets, [sc.num_logprobs for sc, _, _ in plan.prompt_targets])
        for (scoring, pos, _), tl in zip(plan.prompt_targets, read(), strict=True):
            out.prompt_logprobs.append((scoring.seq_id, pos, tl))
    def logits_of(rows: list[int]) -> torch.Tensor:
        return model.compute_logits(hidden[runner.io.upload(rows)])

    plain = _sample_plain(runner, step, per_chunk, plan.sample_rows, logits_of, token_masks)
    verified = _verify(runner, specs, drafts, logits_of)
    accepted = {s.chunk: n for s, (n, _) in zip(specs, verified, strict=True)}
    _undo(runner, step, specs, accepted, checkpoint)
    _extend(runner, step, offsets, accepted, batch.captured, plan.positions)
    return _handle(step, per_chunk, specs, verified, out, plain)


def _decode_only(step: StepInput, per_chunk: list[list[ScheduledSample]]) -> bool:
    """Every chunk is its sequence's anchor alone and samples one token (no fork, no prompt logprobs)."""
    return (all(len(c.token_ids) == 1 for c in step.chunks) and all(len(s) == 1 for s in per_chunk)
            and not any(step.prompt_scoring or ()))


def _launch_verify_step(runner: SpeculativeRunner, graphs: VerifyGraphs, step: StepInput,
                        per_chunk: list[list[ScheduledSample]], specs: list[_Spec], drafts: Drafts | None,
                        token_masks: TokenMaskProvider | None) -> StepHandle:
    """A pure-decode step with drafts as a replayed verify step (``runner/verify_graphs.py``): sequence ``i``'s
    rows ``i * q ..`` are its anchor and drafts; the model keeps the accepted rows (the target's own token is the
    next step's anchor), so nothing is undone or fed again."""
    assert drafts is not None
    model = runner.model
    q = 1 + max(s.count for s in specs)
    width = drafts.tokens.shape[1]
    for s in specs:
        s.rows = [s.chunk * q + j for j in range(s.count + 1)]
    dst = [s.chunk * q + 1 + j for s in specs for j in range(s.count)]
    src = [s.index * width + j for s in specs for j in range(s.count)]
    tokens = drafts.tokens.flatten()[runner.io.upload(src)] if src else drafts.tokens.new_zeros(0)
    result = graphs.run(step.states, [c.token_ids[0] for c in step.chunks], q, tokens, runner.io.upload(dst))

    def logits_of(rows: list[int]) -> torch.Tensor:
        return model.compute_logits(result.hidden[runner.io.upload(rows)])

    anchors = [i * q for i in range(len(step.chunks))]  # each sequence's first row
    plain = _sample_plain(runner, step, per_chunk, anchors, logits_of, token_masks)
    device = model.device
    advance: list[Callable[[list[int]], None]] = []

    def commit(accepted: torch.Tensor) -> None:  # queued before the read-back, from the device's counts
        kept = torch.ones(len(step.chunks), dtype=torch.int64, device=accepted.device)
        kept.index_add_(0, runner.io.upload([s.chunk for s in specs]), accepted)
        advance.append(graphs.model.commit_verify(result.record, step.states, kept, q,
                                                  lambda t: runner.io.backend.to_device(t, device)))

    verified = _verify(runner, specs, drafts, logits_of, commit)
    accepted = {s.chunk: n for s, (n, _) in zip(specs, verified, strict=True)}
    advance[0]([1 + accepted.get(i, 0) for i in range(len(step.chunks))])
    if graphs.extender is None:
        positions = [c.start + j for c in step.chunks for j in range(q)]
        _extend(runner, step, anchors, accepted, result.features, positions)
    return _handle(step, per_chunk, specs, verified, RunnerOutput(), plain)


def _handle(step: StepInput, per_chunk: list[list[ScheduledSample]], specs: list[_Spec],
            verified: list[tuple[int, list[TokenLogprobs]]], out: RunnerOutput, plain: list[TokenLogprobs]
            ) -> StepHandle:
    """The step's results (already read) in sample order, with each speculating chunk's SpecResult."""
    by_chunk = {s.chunk: (s, got) for s, got in zip(specs, verified, strict=True)}
    for i, samples in enumerate(per_chunk):
        if i in by_chunk:
            s, (n, tls) = by_chunk[i]
            out.sampled += [(s.sample.seq_id, tl) for tl in tls]
            out.spec.append(SpecResult(s.sample.seq_id, s.count, n, step.states[i].num_tokens,
                                       s.confidence))  # every drafted position: the next budget's snapshot
        else:
            out.sampled += [(sample.seq_id, plain.pop(0)) for sample in samples]
    return StepHandle(None, [s.seq_id for s in step.samples], lambda: out)


def _undo(runner: SpeculativeRunner, step: StepInput, specs: list[_Spec], accepted: dict[int, int],
          checkpoint: StateCheckpoint | None) -> None:
    """Restore every sequence that rejected a draft.  One whose chunk was the anchor alone feeds its accepted
    tokens again with its next chunk; one whose chunk already re-fed tokens gets them (and its accepted drafts)
    committed now in one more forward, so a chunk never exceeds anchor + drafts + 1 tokens, however many steps in
    a row reject.  With captured verify steps every rejecting sequence commits now: its next chunk is its anchor
    alone, so the next step can be a verify step (a re-fed chunk would keep the whole batch eager)."""
    rejected = [index for index, s in enumerate(specs) if accepted[s.chunk] < s.count]
    if rejected:
        assert checkpoint is not None
        checkpoint.restore(rejected)
    commit = []
    for s in (specs[index] for index in rejected):
        chunk = step.chunks[s.chunk]
        if len(chunk.token_ids) > 1 or runner.verify_graphs is not None:
            commit.append((step.states[s.chunk], chunk.start, chunk.token_ids + s.emitted[: accepted[s.chunk]]))
    if not commit:
        return
    ids = [t for _, _, tokens in commit for t in tokens]
    positions = [start + j for _, start, tokens in commit for j in range(len(tokens))]
    io = runner.io
    runner.model.forward(ForwardBatch(io.upload(ids), io.upload(positions), [len(t) for _, _, t in commit],
                                      [state for state, _, _ in commit], to_device=io.backend.to_device))


def _sample_plain(runner: SpeculativeRunner, step: StepInput, per_chunk: list[list[ScheduledSample]],
                  sample_rows: list[int], logits_of: LogitsOf, masks: TokenMaskProvider | None
                  ) -> list[TokenLogprobs]:
    """Tokens of the sampling chunks without drafts (prefill ends, forks), as the plain runner draws them."""
    rows, samples, flat = [], [], iter(sample_rows)
    for chunk, chunk_samples in zip(step.chunks, per_chunk, strict=True):
        for sample in chunk_samples:
            row = next(flat)
            if not chunk.num_drafts:
                rows.append(row)
                samples.append(sample)
    if not rows:
        return []
    logits = logits_of(rows)
    sampling = [s.row for s in samples]
    bitmask = masks.token_bitmask(sampling, logits.shape[-1], logits.device) if masks is not None else None
    tokens = runner.sampler(logits, sampling, bitmask)
    return runner.io.logprobs(logits, tokens, [r.params.logprobs or 0 for r in sampling])()


def _verify(runner: SpeculativeRunner, specs: list[_Spec], drafts: Drafts | None, logits_of: LogitsOf,
            before_read: Callable[[torch.Tensor], None] | None = None) -> list[tuple[int, list[TokenLogprobs]]]:
    """Per speculating chunk: (drafts accepted, the logprobs of every token it gets); sets ``_Spec.emitted``.
    ``before_read(accepted)``: device work on the counts ([len(specs)] int64) queued before the step's read-back."""
    if not specs:
        return []
    assert drafts is not None
    logits = logits_of([r for s in specs for r in s.rows])
    sampling = [verify_rows(s.sample.row, s.drafts if s.drafts is not None else s.count) for s in specs]
    bitmask = None
    if any(s.mask is not None for s in specs):
        width = (logits.shape[-1] + 31) // 32
        parts = [s.mask if s.mask is not None else torch.full((len(s.rows), width), -1, dtype=torch.int32)
                 for s in specs]
        bitmask = runner.io.backend.to_device(torch.cat(parts), logits.device)
    k = max(s.count for s in specs)
    index = runner.io.upload([s.index for s in specs])
    tokens_in = drafts.tokens[index, :k]
    counts = [s.count for s in specs]
    if runner.forced is None:
        tokens, accepted = verify(runner.io.ops, runner.sampler, logits, sampling, tokens_in, counts, bitmask)
    else:  # benchmarks: accept L - 1 drafts a step on average (lossy)
        tokens, accepted = forced(runner.sampler, logits, sampling, tokens_in, counts,
                                  [runner.forced.next_count()] * len(specs))
    # every target row's logprobs of the token at its position (an accepted draft, or the request's own token;
    # rows after that are computed and dropped), queued before the step's one read-back
    where = [i * (k + 1) + j for i, s in enumerate(specs) for j in range(s.count + 1)]
    chosen = tokens.flatten()[runner.io.upload(where)].clamp(min=0)
    logprobs = runner.io.logprobs(logits, chosen, [s.sample.row.params.logprobs or 0
                                                 for s in specs for _ in range(s.count + 1)])
    confidence = runner.io.backend.to_host_async(drafts.confidence[:, : drafts.tokens.shape[1]])
    if before_read is not None:
        before_read(accepted)
    read = torch.cat([accepted[:, None], tokens], dim=1).tolist()  # the one wait for the step
    every, conf = logprobs(), confidence().tolist()
    out, start = [], 0
    for s, row in zip(specs, read, strict=True):
        n = row[0]
        s.emitted, s.confidence = row[1 : n + 2], conf[s.index]
        out.append((n, every[start : start + n + 1]))
        start += s.count + 1
    return out


def _extend(runner: SpeculativeRunner, step: StepInput, offsets: list[int], accepted: dict[int, int],
            captured: torch.Tensor | None, positions: list[int]) -> None:
    """Give the drafter the target features (``captured``: of every row of the step) of every position the step
    fed and the target kept."""
    rows: list[int] = []
    states: list[SequenceState] = []
    for i, chunk in enumerate(step.chunks):
        kept = len(chunk.token_ids) + accepted.get(i, 0)
        rows += range(offsets[i], offsets[i] + kept)
        states += [step.states[i]] * kept
    if captured is not None:
        features = captured[runner.io.upload(rows)]
    else:
        features = torch.zeros(len(rows), 0, device=runner.model.device)
    runner.drafter.extend(states, runner.io.upload([positions[r] for r in rows]), features)

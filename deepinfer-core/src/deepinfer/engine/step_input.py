"""The runner's view of a scheduled step: the scheduler's chunks plus what the runner needs of their sequences.

The scheduler decides token counts; this turns its output into ``deepinfer.step.StepInput`` (states, sampled
rows with their sampling info, prompt tokens to score), so the runner never sees a ``Request`` or ``Sequence``.
"""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer.engine.request import Sequence
from deepinfer.engine.state_cache import StateCache
from deepinfer.step import PromptScoring, SamplingRow, ScheduledChunk, ScheduledSample, SchedulerOutput, StepInput


def build_step_input(sched: SchedulerOutput, seqs: Mapping[int, Sequence], states: StateCache) -> StepInput:
    """``sched`` with each chunk's state (created empty on first use), sampled rows and prompt scoring."""
    step = StepInput(chunks=list(sched.chunks), states=[])
    for chunk in sched.chunks:
        seq = seqs[chunk.seq_id]
        step.states.append(states.get(chunk.seq_id))
        step.prompt_scoring.append(prompt_scoring(seq, chunk))
        step.needed_from.append(needed_from(seq))
        if chunk.sample:
            step.samples += [scheduled_sample(seqs[sid]) for sid in (chunk.seq_id, *chunk.fork_to)]
    return step


def needed_from(seq: Sequence) -> int:
    """The first position whose output the engine reads: the last known token's (its row gives the next token),
    or the first prompt position still to be scored for ``prompt_logprobs``."""
    request = seq.request
    if seq.index == 0 and request.wants_prompt_logprobs and request.prompt_logprobs is not None:
        return max(len(request.prompt_logprobs) - 1, 0)
    return seq.num_tokens - 1


def scheduled_sample(seq: Sequence) -> ScheduledSample:
    """The row that samples ``seq``'s next token.  Its output position counts a token still in flight."""
    row = SamplingRow(seq.request.params, seq.seed, seq.num_output + seq.num_inflight,
                      seq.request.prompt_token_ids, seq.output_ids, seq.grammar)
    return ScheduledSample(seq.seq_id, row, seq.num_inflight > 0)


def prompt_scoring(seq: Sequence, chunk: ScheduledChunk) -> PromptScoring | None:
    """Prompt tokens ``chunk`` scores for its request's ``prompt_logprobs`` (sequence 0 only), resuming after
    the positions earlier steps recorded; ``None`` when there are none."""
    request = seq.request
    if seq.index != 0 or not request.wants_prompt_logprobs or request.prompt_logprobs is None:
        return None
    first = max(chunk.start, len(request.prompt_logprobs) - 1)
    end = min(chunk.start + len(chunk.token_ids), request.prompt_len - 1)
    if first >= end or request.params.prompt_logprobs is None:
        return None
    return PromptScoring(seq.seq_id, first, request.prompt_token_ids[first + 1 : end + 1],
                         request.params.prompt_logprobs)

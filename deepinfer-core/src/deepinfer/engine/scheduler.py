"""Continuous batching with chunked prefill: decide, per step, which sequences run how many tokens.

Policy (one step, a token budget of ``max_num_batched_tokens``):

1. Running sequences first, oldest first: each gets its remaining tokens (1 when decoding, the rest of
   its prompt or recompute otherwise) up to the budget left.  If the state budget cannot hold its
   growth, the newest running sequences are preempted (state dropped, recomputed later from their
   tokens) until it fits; a sequence may preempt itself when it is the newest.
2. Then waiting sequences, first come first served, while the budget, ``max_num_seqs`` and the state
   memory allow; preempted sequences wait at the front.  No admission in a step that preempted.
   With prefix caching, a sequence starting from scratch asks ``prefix_lookup`` for a cache hit ``C`` and the
   replay start ``R``: it then starts at ``R`` (the engine attaches the cached state), but only when the replay
   and one more token fit this step's budget, so a replay always runs whole in one ragged chunk.

``schedule()`` returns plain data and advances ``num_computed`` at once (the runner will compute the
scheduled tokens), so the next step could be scheduled while this one runs.

Speculative decoding (a ``SpecPolicy``): a running sequence that has output and whose chunk reaches its last
token also verifies drafts after it, as many as the policy gives it (``spec_decode/budget.py``) within its
``max_tokens`` and the step's token budget; its state budget covers the drafts.  ``num_computed`` then assumes
every draft passes; the engine corrects it when the step is read (``SpecResult.num_computed``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from deepinfer.engine.request import Request, Sequence, SequenceStatus
from deepinfer.engine.state_cache import StateBudget
from deepinfer.spec_decode.budget import SpecPolicy
from deepinfer.step import PLACEHOLDER, ScheduledChunk, SchedulerOutput

__all__ = ["PLACEHOLDER", "ScheduledChunk", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Owns the waiting queue and the running list; reads and writes only plain sequence fields."""

    def __init__(self, budget: StateBudget, max_num_seqs: int, max_num_batched_tokens: int,
                 spec: SpecPolicy | None = None):
        self.budget = budget
        self.spec = spec
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        #: Prefix caching: ``(replay start, cached tokens)`` for a sequence starting from scratch ((0, 0): miss).
        self.prefix_lookup: Callable[[Sequence], tuple[int, int]] | None = None

    # --- queue management -----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request: sequence 0 runs the prompt, the others wait to be forked from it."""
        first, *forks = request.sequences
        for seq in forks:
            seq.status = SequenceStatus.AWAITING_FORK
        first.pending_forks = list(forks)
        first.status = SequenceStatus.WAITING
        self.waiting.append(first)

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (stopped or aborted) and release its state budget."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.budget.release(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def clear(self) -> None:
        """Forget every sequence and release the whole state budget (the engine drops all its requests)."""
        for seq in (*self.waiting, *self.running):
            seq.status = SequenceStatus.FINISHED
        self.waiting.clear()
        self.running.clear()
        self.budget.clear()

    def _num_slots(self) -> int:
        """Sequences counted against ``max_num_seqs``: running ones and the forks they will spawn."""
        return sum(1 + len(s.pending_forks) for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.budget.release(seq.seq_id)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --- one step -------------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, num_tokens: int, drafts: int = 0) -> tuple[ScheduledChunk, list[Sequence], int]:
        """The next chunk of ``seq`` and the bytes it needs (its growth, drafts included, plus copies for its
        forks)."""
        start, end = seq.num_computed, seq.num_computed + num_tokens
        forks = seq.pending_forks if end == seq.num_tokens else []
        need = self.budget.extra_for(seq.seq_id, end + drafts) + len(forks) * self.budget.bytes_for(end)
        token_ids = seq.token_ids[start:end]
        token_ids += [PLACEHOLDER] * (end - start - len(token_ids))  # in-flight tokens
        chunk = ScheduledChunk(seq.seq_id, start, token_ids, end == seq.num_tokens, tuple(f.seq_id for f in forks),
                               drafts)
        return chunk, forks, need

    def _commit(self, seq: Sequence, chunk: ScheduledChunk, forks: list[Sequence]) -> list[Sequence]:
        end = chunk.start + len(chunk.token_ids)
        self.budget.grow(seq.seq_id, end + chunk.num_drafts)
        seq.num_computed = end + chunk.num_drafts
        for child in forks:
            self.budget.grow(child.seq_id, end)
            child.num_computed = end
            child.status = SequenceStatus.RUNNING
        seq.pending_forks = [] if forks else seq.pending_forks
        return forks

    def _draft_cap(self, seq: Sequence) -> int:
        """The most drafts ``seq`` may verify this step (0: it does not speculate)."""
        if self.spec is None or seq.num_output == 0 or seq.num_inflight or seq.pending_forks:
            return 0
        return max(0, min(self.spec.max_draft_len, seq.request.max_total_tokens - seq.num_tokens - 1))

    def _draft_lengths(self) -> dict[int, int]:
        """Drafts per running sequence this step, from the policy (the confidences of each one's last drafts)."""
        if self.spec is None:
            return {}
        seqs = [s for s in self.running if self._draft_cap(s)]
        base = min(sum(s.num_uncomputed for s in self.running), self.max_num_batched_tokens)
        lengths = self.spec.lengths([self._draft_cap(s) for s in seqs], [s.draft_confidence for s in seqs], base)
        return {s.seq_id: k for s, k in zip(seqs, lengths, strict=True)}

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        tokens_left = self.max_num_batched_tokens
        forked: list[Sequence] = []
        drafts = self._draft_lengths()

        i = 0
        while i < len(self.running) and tokens_left > 0:
            seq = self.running[i]
            last_in_flight = seq.num_inflight > 0 and seq.num_tokens >= seq.request.max_total_tokens
            if seq.num_uncomputed == 0 or last_in_flight:  # (the latter finishes by length when it is read)
                i += 1
                continue
            num = min(seq.num_uncomputed, tokens_left)
            k = min(drafts.get(seq.seq_id, 0), tokens_left - num) if num == seq.num_uncomputed else 0
            chunk, forks, need = self._chunk(seq, num, k)
            while need > self.budget.free:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it was the newest: nothing after it to schedule
            forked += self._commit(seq, chunk, forks)
            out.chunks.append(chunk)
            tokens_left -= len(chunk.token_ids) + chunk.num_drafts
            i += 1
        # Forks join after the loop so that they are never chosen as victims in the step they are born.
        self.running.extend(forked)

        while self.waiting and tokens_left > 0 and not out.preempted:
            seq = self.waiting[0]
            if self._num_slots() + 1 + len(seq.pending_forks) > self.max_num_seqs:
                break
            if self.prefix_lookup is not None and seq.num_computed == 0:
                start, seq.num_cached = self.prefix_lookup(seq)
                if seq.num_cached - start + 1 <= tokens_left:  # the replay and a token after it run now
                    seq.num_computed = start
                else:
                    seq.num_cached = 0
            chunk, forks, need = self._chunk(seq, min(seq.num_uncomputed, tokens_left))
            if need > self.budget.free:
                seq.num_computed = seq.num_cached = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.running.extend(self._commit(seq, chunk, forks))
            out.chunks.append(chunk)
            tokens_left -= len(chunk.token_ids)
        return out

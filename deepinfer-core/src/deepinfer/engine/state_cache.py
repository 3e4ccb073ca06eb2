"""The state cache: every sequence's model state, and the byte budget that bounds it.

A V4 sequence's state is several kinds of memory (SWA rings, paged compressed entries and indexer keys,
unfinished compressor windows); the model packs them in one ``SequenceState``.  The engine sizes them
all from one number: bytes, and this module is its one owner: :func:`state_budget` chooses it (the user's
``state_cache_bytes``, else what ``max_num_seqs`` sequences need within the free device memory), and
``StateCache`` configures the model's state memory with it (``model.configure_state``), which says how many
bytes and sequences it really holds.  ``StateBudget`` is the scheduler's plain-integer view (reserve the upper
bound ``model.state_bytes(n)`` before a sequence grows to ``n`` tokens; refuse or preempt when it does
not fit).  ``StateCache`` holds the states themselves and is touched only by the engine and runner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.backends import Backend
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.sizing import model_max_len
from deepinfer.kv.prefix_cache import PrefixCache
from deepinfer.models.base import CausalLM, PrefixCacheable, SequenceState, StateCapacity

#: Tokens per sequence the default state cache budget is sized for (``max_num_seqs`` of them); longer
#: sequences still run, fewer at a time.
DEFAULT_STATE_TOKENS = 8192


def state_budget(args: EngineArgs, model: CausalLM, backend: Backend) -> int:
    """Bytes of state to configure: ``state_cache_bytes`` when given, else what ``max_num_seqs`` sequences of
    ``min(max_model_len, 8192)`` tokens need, at most ``gpu_memory_utilization`` of the memory the backend reports
    free on the model's device (a backend that reports none: no cap)."""
    if args.state_cache_bytes is not None:
        return args.state_cache_bytes
    tokens = min(args.max_model_len or model_max_len(getattr(model, "config", None)), DEFAULT_STATE_TOKENS)
    want = model.state_pool_bytes(args.max_num_seqs, tokens)
    try:
        free = backend.memory_info(torch.device(model.device))[0]
    except NotImplementedError:
        return want
    return min(want, int(args.gpu_memory_utilization * free))


class StateBudget:
    """Bytes reserved per sequence against a fixed capacity.  Plain integers only."""

    __slots__ = ("capacity", "_bytes_for", "_reserved", "_used")

    def __init__(self, capacity: int, bytes_for: Callable[[int], int]):
        self.capacity = int(capacity)
        self._bytes_for = bytes_for
        self._reserved: dict[int, int] = {}
        self._used = 0

    def bytes_for(self, num_tokens: int) -> int:
        """Upper bound on the state of a sequence holding ``num_tokens`` tokens."""
        return self._bytes_for(num_tokens) if num_tokens > 0 else 0

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    def reserved(self, seq_id: int) -> int:
        return self._reserved.get(seq_id, 0)

    def extra_for(self, seq_id: int, num_tokens: int) -> int:
        """Additional bytes ``seq_id`` needs to grow to ``num_tokens`` tokens."""
        return max(0, self.bytes_for(num_tokens) - self.reserved(seq_id))

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Reserve for ``seq_id`` holding ``num_tokens`` tokens (caller checked it fits)."""
        extra = self.extra_for(seq_id, num_tokens)
        if extra > self.free:
            raise RuntimeError(f"state budget overrun: sequence {seq_id} needs {extra} bytes, {self.free} free")
        self._reserved[seq_id] = self.reserved(seq_id) + extra
        self._used += extra

    def release(self, seq_id: int) -> None:
        self._used -= self._reserved.pop(seq_id, 0)

    def clear(self) -> None:
        """Release every reservation."""
        self._reserved.clear()
        self._used = 0


class StateCache:
    """Owns the ``SequenceState`` of every sequence that has one; created lazily, freed explicitly.

    Built before any state exists: it configures the model's state memory for at most ``max_seqs`` sequences
    within ``capacity_bytes`` (:attr:`capacity`: what that holds, fewer sequences or bytes when the budget buys
    less), and keeps the live states within it."""

    __slots__ = ("model", "capacity", "budget", "_states", "on_release", "prefix")

    def __init__(self, model: CausalLM, max_seqs: int, capacity_bytes: int, prefix_caching: bool = False):
        self.model = model
        self.capacity: StateCapacity = model.configure_state(max_seqs, capacity_bytes)
        self.budget = StateBudget(self.capacity.nbytes, model.state_bytes)
        self._states: dict[int, SequenceState] = {}
        #: Called with each state just before it is released (the drafter forgets that slot's context).
        self.on_release: Callable[[SequenceState], None] | None = None
        #: The prefix cache (``deepinfer.kv.prefix_cache.PrefixCache``) when prefix caching is on.
        self.prefix: PrefixCache | None = None
        if prefix_caching:
            if not isinstance(model, PrefixCacheable):
                raise ValueError(f"enable_prefix_caching=True: {type(model).__name__} has no prefix cache (it "
                                 "needs a pooled state, as DeepSeek-V4 and V4.1 have)")
            self.prefix = model.new_prefix_cache()

    # --- prefix caching ---------------------------------------------------------------------------
    def lookup(self, tokens: list[int], needed: int) -> tuple[int, int]:
        """(replay start, cached tokens) for a sequence of ``tokens`` starting from scratch whose first read
        output is at ``needed``: the longest cached prefix that leaves a token to compute, (0, 0) if none or if
        its replay would start at 0."""
        assert self.prefix is not None and isinstance(self.model, PrefixCacheable)
        hit = self.prefix.match(tokens, min(len(tokens) - 1, needed))
        start = self.model.replay_start(hit, needed) if hit else 0
        return (start, hit) if start > 0 else (0, 0)

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admitted sequence's lookup: its prompt tokens, and the cached tokens it starts from."""
        assert self.prefix is not None
        self.prefix.stats.record(query_tokens, hit_tokens)

    def attach(self, seq_id: int, tokens: list[int], hit: int, start: int) -> None:
        """Create ``seq_id``'s state from the cached entries of ``tokens[:hit]``, to be replayed from ``start``."""
        assert self.prefix is not None
        self.prefix.attach(self.get(seq_id), tokens, hit, start)  # type: ignore[arg-type]

    def publish(self, seq_id: int, tokens: list[int], upto: int) -> None:
        """Cache the blocks of ``tokens[:upto]`` that ``seq_id``'s state holds (after its step is queued)."""
        assert self.prefix is not None
        self.prefix.publish(self._states[seq_id], tokens, upto)  # type: ignore[arg-type]

    def get(self, seq_id: int) -> SequenceState:
        """The state of ``seq_id``, created empty on first use."""
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = self.model.new_state()
        return state

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` an independent copy of ``parent_id``'s state (``n > 1`` prompt sharing)."""
        self._states[child_id] = self._states[parent_id].fork()

    def free(self, seq_id: int) -> None:
        """Drop the state of ``seq_id`` (finished or preempted); a later ``get`` starts from empty."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            self._release(state)

    def _release(self, state: SequenceState) -> None:
        if self.on_release is not None:
            self.on_release(state)
        state.release()

    def clear(self) -> None:
        """Drop every state (the engine dropped all its sequences) and the cached prefixes."""
        states, self._states = list(self._states.values()), {}
        for state in states:
            self._release(state)
        if self.prefix is not None:
            self.prefix.clear()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> int:
        """Bytes the live states hold now (at most ``budget.used``)."""
        return sum(s.nbytes() for s in self._states.values())

"""What an engine has counted and holds now, as plain numbers: one rank's, or every rank's summed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.engine.engine import Engine
    from deepinfer.engine.stats import EngineStats


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    #: Sequences holding state.
    num_sequences: int = 0
    num_preemptions: int = 0
    #: State cache bytes reserved by live sequences, of the budget.
    state_used: int = 0
    state_capacity: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @classmethod
    def of(cls, engine: Engine) -> EngineCounters:
        budget, prefix = engine.state_cache.budget, engine.state_cache.prefix
        return cls(engine.num_prompt_tokens, engine.num_generated_tokens, len(engine.scheduler.running),
                   len(engine.scheduler.waiting), len(engine.seqs), engine.num_preemptions, budget.used,
                   budget.capacity, prefix.stats.query_tokens if prefix is not None else 0,
                   prefix.stats.hit_tokens if prefix is not None else 0)

    @classmethod
    def total(cls, parts: list[EngineCounters]) -> EngineCounters:
        """Every rank's counts summed (each data-parallel rank's engine holds its own requests)."""
        return cls(*(sum(getattr(p, name) for p in parts) for name in cls.__slots__))

    def copy_to(self, stats: EngineStats) -> None:
        """Into the server's statistics (the live values and the engine's running totals)."""
        stats.prompt_tokens = self.prompt_tokens
        stats.generation_tokens = self.generation_tokens
        stats.num_running = self.num_running
        stats.num_waiting = self.num_waiting
        stats.num_sequences = self.num_sequences
        stats.num_preemptions = self.num_preemptions
        stats.state_cache_usage = self.state_used / self.state_capacity if self.state_capacity else 0.0
        stats.prefix_cache_queries = self.prefix_cache_queries
        stats.prefix_cache_hits = self.prefix_cache_hits

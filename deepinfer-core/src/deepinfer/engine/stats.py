"""Serving statistics: counters and latency histograms the async engine fills, ``/metrics`` renders.

Plain numbers only; they are written by the engine thread and read (a consistent enough snapshot: each
value is one Python object) by the server.  Latencies come from ``RequestOutput.metrics``: TTFT is
``first_token_time - arrival_time``, inter-token latency the time between two steps that gave a request
tokens, end-to-end ``finished_time - arrival_time``, queue time ``first_scheduled_time - arrival_time`` (the
step is stamped when it is scheduled, before its forward pass).  The server's arrival is when it received the
request, before tokenization.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

#: Bucket upper bounds in seconds (vLLM's TTFT / ITL buckets, shortened at both ends).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus' shape): ``counts[i]`` observations ``<= bounds[i]``."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i in range(bisect.bisect_left(self.bounds, value), len(self.bounds)):
            self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass(slots=True)
class EngineStats:
    """What the async engine counted since it started."""

    #: Finished requests by finish reason of their first completion (``stop``, ``length``, ``error``, ``abort``).
    requests: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    e2e_request_latency: Histogram = field(default_factory=Histogram)
    queue_time: Histogram = field(default_factory=Histogram)
    #: vLLM's request phases: first scheduled step to finish, to first token; first token to last token.
    inference_time: Histogram = field(default_factory=Histogram)
    prefill_time: Histogram = field(default_factory=Histogram)
    decode_time: Histogram = field(default_factory=Histogram)
    #: Live values, refreshed by the engine thread after each step.
    num_running: int = 0
    num_waiting: int = 0
    #: Sequences holding state (a request with ``n`` completions has ``n``); 0 when nothing runs.
    num_sequences: int = 0
    num_preemptions: int = 0
    #: Fraction of the state cache budget reserved by live sequences.
    state_cache_usage: float = 0.0
    #: Prefix caching: prompt tokens looked up, and those found cached (0 when it is off).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Speculative decoding (DSpark) of finished requests, summed: verify steps, drafts verified, drafts accepted,
    #: and accepted drafts per block position (vLLM's ``spec_decode_*`` counters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def add_spec(self, num_drafts: int, num_draft_tokens: int, num_accepted: int, per_pos: list[int]) -> None:
        """Count one finished request's speculative decoding."""
        self.spec_num_drafts += num_drafts
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        if len(per_pos) > len(self.spec_accepted_per_pos):
            self.spec_accepted_per_pos += [0] * (len(per_pos) - len(self.spec_accepted_per_pos))
        for i, n in enumerate(per_pos):
            self.spec_accepted_per_pos[i] += n

"""Measure what a target step costs by its token count: the cost table of confidence-scheduled verification.

At start-up (``DEEPINFER_ENABLE_MTP_VARLEN=1`` with a drafter) the engine times one forward per bucket of step
tokens (powers of two from one request's verify block up to the step limit), each spread over as many sequences
as that many blocks make, on scratch states that are released afterwards.  The budget then weighs the expected
accepted tokens of each extra draft against the measured cost of the bigger step (``spec_decode/budget.py``).
"""

from __future__ import annotations

import time

import torch

from deepinfer.backends import Backend
from deepinfer.models.base import CausalLM, ForwardBatch
from deepinfer.spec_decode.budget import CostTable

#: Tokens each scratch sequence holds before it is timed (a short context, as in decoding).
CONTEXT = 8


def buckets(block: int, max_tokens: int) -> list[int]:
    """Step sizes to time: ``block``, then powers of two up to ``max_tokens`` (which is included)."""
    out, n = [block], 1
    while n < max_tokens:
        n *= 2
        if n > block:
            out.append(min(n, max_tokens))
    return sorted(set(out))


def _forward(model: CausalLM, backend: Backend, states: list, lens: list[int], start: int) -> float:
    ids = [3 + (i % max(1, model.vocab_size - 3)) for i in range(sum(lens))]
    positions = [start + j for n in lens for j in range(n)]
    batch = ForwardBatch(backend.to_device(torch.tensor(ids), model.device),
                         backend.to_device(torch.tensor(positions), model.device), lens, states,
                         to_device=backend.to_device)
    backend.synchronize(model.device)
    began = time.perf_counter()
    with torch.no_grad():
        model.forward(batch)
    backend.synchronize(model.device)
    return time.perf_counter() - began


def profile_step_costs(model: CausalLM, backend: Backend, block: int, max_tokens: int, max_seqs: int,
                       repeats: int = 2) -> CostTable:
    """Seconds of one target forward per bucket (best of ``repeats``); ``block``: one request's verify tokens
    (anchor + drafts).  The states are scratch: made, timed and released here."""
    sizes, costs = buckets(block, max_tokens), []
    for size in sizes:
        seqs = max(1, min(max_seqs, size // block))
        lens = [size // seqs + (1 if i < size % seqs else 0) for i in range(seqs)]
        best = float("inf")
        for _ in range(repeats):
            states = [model.new_state() for _ in range(seqs)]
            try:
                _forward(model, backend, states, [CONTEXT] * seqs, 0)
                best = min(best, _forward(model, backend, states, lens, CONTEXT))
            finally:
                for state in states:
                    state.release()
        costs.append(max(best, 1e-9))
    for i in range(1, len(costs)):  # a bigger step never costs less (timing noise)
        costs[i] = max(costs[i], costs[i - 1])
    return CostTable(tuple(sizes), tuple(costs))

"""Feeding a model directly (no engine): teacher-forced log-probabilities whole, chunked or in ragged batches.

What the oracle tests compare with transformers and the fixtures, and what a backend or a training tool can use
to check a model's outputs on its own device.
"""

from __future__ import annotations

import torch

from deepinfer.models.base import CausalLM, ForwardBatch


def run_chunked(model: CausalLM, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """DeepInfer's teacher-forced log-probabilities [S, V], feeding ``tokens`` ``chunk`` at a time."""
    state, out, device = model.new_state(), [], model.device
    with torch.no_grad():
        for start in range(0, len(tokens), chunk):
            ids = tokens[start : start + chunk].to(device)  # on the model's device, as the engine uploads them
            batch = ForwardBatch(ids, torch.arange(start, start + len(ids), device=device), [len(ids)], [state])
            out.append(model.compute_logits(model.forward(batch)).cpu())
    state.release()  # (the model's pool is then free for an engine)
    return torch.log_softmax(torch.cat(out), dim=-1)


def run_ragged(model: CausalLM, sequences: list[torch.Tensor], schedule: list[list[int]]) -> list[torch.Tensor]:
    """Feed several sequences together: step ``k`` gives sequence ``i`` ``schedule[k][i]`` new tokens (0 = sits
    out).  Returns each sequence's log-probabilities [S_i, V]."""
    states = [model.new_state() for _ in sequences]
    done = [0] * len(sequences)
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    with torch.no_grad():
        for step in schedule:
            members = [i for i, n in enumerate(step) if n]
            ids = torch.cat([sequences[i][done[i] : done[i] + step[i]] for i in members])
            positions = torch.cat([torch.arange(done[i], done[i] + step[i]) for i in members])
            lens = [step[i] for i in members]
            batch = ForwardBatch(ids, positions, lens, [states[i] for i in members])
            logits = model.compute_logits(model.forward(batch))
            for i, rows in zip(members, logits.split(lens), strict=True):
                out[i].append(rows)
                done[i] += step[i]
    for state in states:
        state.release()
    assert done == [len(s) for s in sequences], "schedule does not cover the sequences"
    return [torch.log_softmax(torch.cat(rows), dim=-1) for rows in out]


def run_schedule(model: CausalLM, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities [S, V] of one sequence fed in chunks of the given sizes."""
    assert sum(chunks) == len(tokens), "the chunks do not cover the sequence"
    (out,) = run_ragged(model, [tokens], [[n] for n in chunks])
    return out
